"""Generation (``genome_lm.eval.generate``, ``genome-lm generate``): the log-probability of every
generated base equals a full forward over prompt + generated sequence (fp32, 1e-5), for prompts of
one base and longer than the DSA layers' token budget; a seed reproduces a sample; only A, C, G, T
come out even from a model that favours N; a batch gives what one prompt at a time gives; top-k and
top-p keep the bases they should; bad input is one line with nothing written."""

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.data.tokenizer import BASE_TOKENS, N, tokenize
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.eval.generate import Sampling, generate, pick, prompt_tokens
from genome_lm.model import get_preset
from genome_lm.model.model import build_model


@pytest.fixture
def model():
    with parallel_context() as pg:
        torch.manual_seed(7)
        yield build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()


def _prompt(n, seed=0):
    return np.random.default_rng(seed).choice(np.array(BASE_TOKENS), n).astype(np.uint8)


@torch.no_grad()
def _full_forward_logprobs(model, prompt, generated):
    ids = torch.from_numpy(np.concatenate([prompt, generated]).astype(np.int64))[None]
    logp = torch.log_softmax(model(ids[:, :-1]).logits[0].double(), -1)
    at = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logp[at, ids[0, at + 1]].numpy()


@pytest.mark.parametrize("length,chunk", [(1, 64), (37, 16), (300, 128)], ids=["one-base", "pools", "past-topk"])
def test_logprobs_equal_a_full_forward(model, length, chunk):
    assert 300 > model.cfg.index_topk and 37 > model.cfg.index_kpool
    prompt = _prompt(length, seed=length)
    s = Sampling(n_tokens=40, temperature=1.0, seed=3)
    g, = generate(model, [("p", prompt)], s, chunk=chunk)
    generated = tokenize(g.sequence.encode())
    assert len(g.sequence) == 40 and set(g.sequence) <= set("ACGT")
    np.testing.assert_allclose(g.logprob, _full_forward_logprobs(model, prompt, generated), rtol=1e-5, atol=1e-6)


def test_a_seed_reproduces_a_sample(model):
    prompt = [("p", _prompt(50))]
    s = Sampling(n_tokens=60, temperature=1.5, seed=11)
    a, b = generate(model, prompt, s)[0], generate(model, prompt, s)[0]
    assert a.sequence == b.sequence and np.array_equal(a.logprob, b.logprob)
    other = generate(model, prompt, Sampling(n_tokens=60, temperature=1.5, seed=12))[0]
    assert other.sequence != a.sequence


def test_only_bases_come_out_of_a_model_that_favours_n(model):
    with torch.no_grad():
        model.output_layer.weight[N] *= 0
        model.output_layer.weight[N] += 5 * model.output_layer.weight[BASE_TOKENS[0]].sign()
        model.output_layer.weight[[0, 1, 2, 3]] += model.output_layer.weight[N]
    prompt = _prompt(20)
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits[0, -1].double(), -1)
    assert probs[list(BASE_TOKENS)].sum() < 0.05  # the model would rather say N or a special token
    g, = generate(model, [("p", prompt)], Sampling(n_tokens=30, seed=1))
    assert set(g.sequence) <= set("ACGT") and len(g.sequence) == 30
    np.testing.assert_allclose(g.logprob, _full_forward_logprobs(model, prompt, tokenize(g.sequence.encode())),
                               rtol=1e-5, atol=1e-6)


def test_a_batch_gives_one_prompt_at_a_time(model):
    prompts = [(f"p{i}", _prompt(45, seed=i)) for i in range(3)] + [("short", _prompt(12, seed=9))]
    s = Sampling(n_tokens=25, greedy=True)
    together = generate(model, prompts, s, batch=8)
    alone = [generate(model, [p], s)[0] for p in prompts]
    assert [g.name for g in together] == [p[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.sequence == b.sequence and a.prompt_length == b.prompt_length
        np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-6, atol=1e-7)


def test_top_k_and_top_p_keep_the_bases_they_should():
    scores = torch.log(torch.tensor([[0.6, 0.2, 0.15, 0.05]])).repeat(400, 1)
    rng = torch.Generator().manual_seed(0)
    assert set(pick(scores, Sampling(1, top_p=0.5), rng).tolist()) == {0}
    assert set(pick(scores, Sampling(1, top_p=0.7), rng).tolist()) == {0, 1}
    assert set(pick(scores, Sampling(1, top_k=3), rng).tolist()) == {0, 1, 2}
    assert set(pick(scores, Sampling(1), rng).tolist()) == {0, 1, 2, 3}
    assert set(pick(scores, Sampling(1, greedy=True), rng).tolist()) == {0}
    drawn = pick(scores, Sampling(1, temperature=1.0), rng)
    assert abs((drawn == 0).float().mean().item() - 0.6) < 0.1


def test_generate_command_writes_fasta_and_refuses_bad_input(tmp_path):
    prompts = tmp_path / "prompts.fa"
    prompts.write_text(">a some words\nACGTACGTACGTacgtNNACGT\nACGTAC\n>b\nGGGCCCAAATTT\n")
    out, tsv = tmp_path / "gen.fa", tmp_path / "gen.tsv"
    result = CliRunner().invoke(app, ["generate", "--model", "builtin:tiny-long", "--prompts", str(prompts),
                                      "--prompt", "ACGTTGCA", "--n-tokens", "70", "--seed", "4", "--top-k", "3",
                                      "--out", str(out), "--logprobs", str(tsv), "--quiet"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "wrote 210 bases after 3 prompts" in result.output
    text = out.read_text().splitlines()
    headers = [line for line in text if line.startswith(">")]
    assert headers[0].startswith(">prompt+generated prompt_length=8 n=70 temperature=1 top_k=3 top_p=1 seed=4")
    assert headers[1].startswith(">a+generated prompt_length=28 ")
    assert headers[2].startswith(">b+generated prompt_length=12")
    seqs = "".join(line for line in text if not line.startswith(">"))
    assert len(seqs) == 210 and set(seqs) <= set("ACGT") and max(len(line) for line in text[1:]) <= 60 + 200
    rows = tsv.read_text().splitlines()
    assert rows[0] == "name\tposition\tbase\tlogprob" and len(rows) == 211 and rows[1].startswith("prompt\t9\t")

    base = ["generate", "--model", "builtin:tiny-long", "--n-tokens", "5", "--quiet"]
    for more, said in ((["--prompt", ""], "prompt --prompt: empty"),
                       (["--prompt", "ACGXT"], "'X' at position 4 is not a base"),
                       (["--prompt", "ACGT", "--n-tokens", "0"], "--n-tokens 0: generate at least 1 base"),
                       (["--prompt", "ACGT", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
                       (["--prompt", "ACGT", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
                       ([], "no prompt")):
        bad = tmp_path / "bad.fa"
        result = CliRunner().invoke(app, [*base, *more, "--out", str(bad)])
        assert result.exit_code == 1 and said in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and not bad.exists()
    with pytest.raises(Exception, match="empty"):
        prompt_tokens("x", b"\n")


def test_continuation_prompts_and_probe(model):
    """The repeat prompt ends ``cue`` bases into the second copy, whose first copy lies ``d`` bases
    before it; the control differs only in the first copy; the probe's identities are shares."""
    from genome_lm.eval.probes.continuation import continuation_probe, continuation_prompts
    from genome_lm.eval.probes.recall import LEAD, SequencePool

    pool = SequencePool.random(50_000, seed=1)
    rng = np.random.default_rng(0)
    repeat, control, want = continuation_prompts(pool, rng, 500, 64, 16)
    first = repeat[LEAD:LEAD + 64]
    assert len(repeat) == len(control) == LEAD + 64 + 500 + 16
    assert np.array_equal(repeat[-16:], first[:16]) and np.array_equal(want, first[16:])
    assert np.array_equal(repeat[LEAD + 64:], control[LEAD + 64:]) and not np.array_equal(control[LEAD:LEAD + 64],
                                                                                          first)
    rows = continuation_probe(model, pool, [100, 300], segment=40, cue=8, trials=2)
    assert [r.distance for r in rows] == [100, 300]
    for r in rows:
        assert 0 <= r.repeat_ci[0] <= r.repeat <= r.repeat_ci[1] <= 1 and 0 <= r.control <= 1
