"""Baselines that need no model in every eval report: the order-k Markov chain against a naive
count-by-dictionary implementation, its order chosen on held-out training windows (a known
order-2 source gives 2), and both baselines in the table, JSON, CSV, plot and MLflow."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from genome_lm.data.tokenizer import A, N
from genome_lm.eval.baselines import LN4, MarkovModel, _count, fit_markov


def _naive_nll(train: list[np.ndarray], tokens: np.ndarray, k: int) -> list[float]:
    """For each target j >= 1: the longest N-free context of at most k bases before it in
    ``tokens``, counted over ``train`` with the same rule, add-one smoothing; NaN for N targets."""
    counts: list[Counter] = [Counter() for _ in range(k + 1)]
    totals: list[Counter] = [Counter() for _ in range(k + 1)]
    for seq in train:
        s = [int(t) for t in seq]
        for j, b in enumerate(s):
            if b == N:
                continue
            for m in range(k + 1):
                ctx = tuple(s[j - m:j]) if m else ()
                if j - m < 0 or N in ctx:
                    break
                counts[m][(ctx, b)] += 1
                totals[m][ctx] += 1
    s = [int(t) for t in tokens]
    out = []
    for j in range(1, len(s)):
        if s[j] == N:
            out.append(float("nan"))
            continue
        m = 0
        while m < k and j - (m + 1) >= 0 and s[j - m - 1] != N:
            m += 1
        ctx = tuple(s[j - m:j]) if m else ()
        out.append(-math.log((counts[m][(ctx, s[j])] + 1) / (totals[m][ctx] + 4)))
    return out


def _random_tokens(rng, n, n_frac=0.02):
    t = rng.integers(A, A + 4, n).astype(np.uint8)
    t[rng.random(n) < n_frac] = N
    return t


@pytest.mark.parametrize("k", [0, 1, 3])
def test_markov_scores_equal_a_naive_count(k):
    rng = np.random.default_rng(k)
    train = [_random_tokens(rng, 700), _random_tokens(rng, 301)]
    model = MarkovModel(k, _count(train, k), sum(t.size for t in train), {})
    tokens = _random_tokens(rng, 257)
    got = model.nll(tokens)
    want = np.array(_naive_nll(train, tokens, k))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-12)


def test_the_order_is_chosen_on_held_out_training_windows(tmp_path):
    """A source where each base depends on the two before it: order 2 wins on held-out data."""
    from genome_lm.data.prepare import PrepareRequest, prepare
    from genome_lm.data.windows import WindowSpec
    from tests.conftest import write_fasta

    rng = np.random.default_rng(5)
    table = rng.dirichlet(np.full(4, 0.3), size=16)  # P(next | previous two)
    seq = list(rng.integers(0, 4, 2))
    for _ in range(300_000):
        seq.append(int(rng.choice(4, p=table[seq[-2] * 4 + seq[-1]])))
    text = "".join("ACGT"[b] for b in seq).encode()
    fasta = write_fasta(tmp_path / "g.fa", {"chr1": text[:250_000], "chr22": text[250_000:]})
    prepare(PrepareRequest(fasta, tmp_path / "ds", ("chr1",), ("chr22",), WindowSpec(16_384, 16_384, "keep", 100, 1.0)),
            workers=1, quiet=True, cache_dir=tmp_path / "cache")
    model = fit_markov(tmp_path / "ds", "train")
    assert model.order == 2, model.held_out_nats
    assert model.held_out_nats[2] < model.held_out_nats[1] < model.held_out_nats[0]
    assert model.train_bases >= 240_000


def test_held_out_windows_are_spread_over_the_split(tmp_path):
    """The long recipe's split is chr1, chr2 and a copy drill of random bases, in that order: the
    order is chosen on windows from all of it, not on the drill at its end (which picks order 0)."""
    from genome_lm.data.prepare import PrepareRequest, prepare
    from genome_lm.data.windows import WindowSpec
    from tests.conftest import write_fasta

    rng = np.random.default_rng(6)
    table = rng.dirichlet(np.full(4, 0.3), size=16)
    seq = list(rng.integers(0, 4, 2))
    for _ in range(200_000):
        seq.append(int(rng.choice(4, p=table[seq[-2] * 4 + seq[-1]])))
    text = "".join("ACGT"[b] for b in seq).encode()
    drill = "".join("ACGT"[b] for b in rng.integers(0, 4, 40_000)).encode()
    fasta = write_fasta(tmp_path / "g.fa", {"chr1": text[:180_000], "drill": drill, "chr22": text[180_000:]})
    prepare(PrepareRequest(fasta, tmp_path / "ds", ("chr1", "drill"), ("chr22",),
                           WindowSpec(16_384, 16_384, "keep", 100,
                                      1.0)), workers=1, quiet=True, cache_dir=tmp_path / "c")
    model = fit_markov(tmp_path / "ds", "train")
    # held out on the chain's windows: their order-0 loss is the chain's composition, well under the
    # drill's ln 4 = 1.386; an order >= 2 wins (above 2 when it tells the drill's k-mers apart)
    assert model.held_out_nats[0] < 1.2 and model.order >= 2, model.held_out_nats
    assert model.held_out_nats[2] < model.held_out_nats[1] < model.held_out_nats[0]


def test_baselines_in_every_output(evaluated, demo_run):
    out, report, output = evaluated
    uniform, markov = report["results"]["uniform"], report["results"]["markov"]
    assert uniform["all"]["nats"] == pytest.approx(LN4) and uniform["all"]["bits"] == pytest.approx(2.0)
    assert [b["tokens"] for b in markov["buckets"]] == [b["tokens"] for b in report["results"]["model"]["buckets"]]
    assert markov["all"]["bits"] < 2.0  # the demo genome has composition and repeats a chain sees
    info = report["models"]["markov"]
    assert 0 <= info["order"] <= 8 and set(info["held_out_nats_by_order"]) == {str(k) for k in range(9)}
    text = " ".join(output.split())
    assert "for guessing A, C, G, T uniformly" in text and f"order-{info['order']} Markov chain" in text
    assert any("uniform" in line for line in report["headline"])
    assert any("Markov" in line for line in report["headline"])
    csv_models = {line.split(",")[0] for line in (out / "eval.csv").read_text().splitlines()[1:]}
    assert {"uniform", "markov"} <= csv_models
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{demo_run / 'run' / 'mlflow.db'}")
    metrics = client.get_run(report["mlflow"]["run_id"]).data.metrics
    assert metrics["eval/uniform/all_bits"] == pytest.approx(2.0)
    assert metrics["eval/markov/all_bits"] == pytest.approx(markov["all"]["bits"])
    import matplotlib

    matplotlib.use("Agg")
    from genome_lm.eval.report import loss_figure
    from genome_lm.eval.schema import EvalReport

    legend = [t.get_text() for t in loss_figure(EvalReport.from_json(report)).axes[0].get_legend().get_texts()]
    assert any("uniform" in t for t in legend) and any("Markov" in t for t in legend), legend

