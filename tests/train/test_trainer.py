"""The training loop on CPU: it learns, and a stopped or killed run resumes to the same losses."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from genome_lm.config import load_config
from genome_lm.train.trainer import train


def _config(dataset, out, steps=4, extra=()):
    return load_config("demo-cpu", [f"data.dataset={dataset}", f"train.out_dir={out}", f"train.steps={steps}",
                                    "data.seq_len=256", "train.global_batch_size=2", "train.warmup_steps=1",
                                    "train.indexer_dense_steps=1", "train.save_every=2", "model.kernel_backend=torch",
                                    *extra])


def test_loss_falls_and_everything_is_logged(small_dataset, tmp_path):
    from mlflow.tracking import MlflowClient

    result = train(_config(small_dataset, tmp_path / "run", steps=8, extra=["train.lr=1e-2"]), progress=False)
    losses = [m.lm_loss for m in result.history]
    assert result.steps_done == 8 and len(losses) == 8
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    assert all(m.tokens == 2 * 256 and m.moe_max_over_mean >= 1.0 for m in result.history)
    assert result.checkpoint.name == "step-000008"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run = client.get_run(result.run_id)
    assert run.data.params["train.steps"] == "8"
    history = client.get_metric_history(result.run_id, "lm_loss")
    assert [round(h.value, 5) for h in history] == [round(x, 5) for x in losses]
    for name in ("indexer_loss", "grad_norm", "tokens_per_s", "lr", "peak_host_mib", "moe_busiest_expert_over_mean"):
        assert len(client.get_metric_history(result.run_id, name)) == 8, name
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 1000


@pytest.mark.slow
def test_stopped_run_resumes_bit_for_bit(small_dataset, tmp_path):
    full = train(_config(small_dataset, tmp_path / "full", steps=4), progress=False)
    part = train(_config(small_dataset, tmp_path / "part", steps=4), progress=False, max_steps=2)
    assert part.steps_done == 2
    rest = train(_config(small_dataset, tmp_path / "part", steps=4), progress=False, resume=True)
    assert [m.loss for m in part.history + rest.history] == [m.loss for m in full.history]
    assert [m.grad_norm for m in part.history + rest.history] == [m.grad_norm for m in full.history]
    assert rest.run_id == part.run_id  # the same MLflow run continues


KILLED = textwrap.dedent("""
    import json, os, sys
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    from genome_lm.config import load_config
    from genome_lm.train.trainer import train
    cfg = load_config("demo-cpu", json.loads(sys.argv[1]))
    result = train(cfg, progress=False, resume=sys.argv[2] == "resume")
    print(json.dumps([m.loss for m in result.history]))
""")


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_losses(small_dataset, tmp_path):
    overrides = [f"data.dataset={small_dataset}", "train.steps=6", "data.seq_len=256", "train.global_batch_size=2",
                 "train.save_every=2", "model.kernel_backend=torch"]
    full = subprocess.run([sys.executable, "-c", KILLED, json.dumps(overrides + [f"train.out_dir={tmp_path / 'a'}"]),
                           "fresh"], capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    expected = json.loads(full.stdout.strip().splitlines()[-1])
    args = overrides + [f"train.out_dir={tmp_path / 'b'}"]
    proc = subprocess.Popen([sys.executable, "-c", KILLED, json.dumps(args), "fresh"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "b" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() >= "step-000004"):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = int(latest.read_text().strip()[-6:])
    assert 2 <= done < 6
    resumed = subprocess.run([sys.executable, "-c", KILLED, json.dumps(args), "resume"], capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1]) == expected[done:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_checkpoints_and_stops(small_dataset, tmp_path, sig):
    args = [f"data.dataset={small_dataset}", "train.steps=50", "data.seq_len=256", "train.global_batch_size=2",
            "model.kernel_backend=torch", f"train.out_dir={tmp_path / 'c'}", "train.save_every=0"]
    proc = subprocess.Popen([sys.executable, "-c", KILLED, json.dumps(args), "fresh"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    mlflow_db = tmp_path / "c" / "mlflow.db"
    deadline = time.time() + 300
    while time.time() < deadline and not mlflow_db.exists():
        time.sleep(0.1)
    time.sleep(3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    losses = json.loads(out.strip().splitlines()[-1])
    assert 0 < len(losses) < 50
    latest = (tmp_path / "c" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{len(losses):06d}"


def _poison_steps(monkeypatch, bad_steps):
    """Make the loss NaN on ``bad_steps`` (1-based; two micro-batches per step here)."""
    import torch

    from genome_lm.train import step

    original, calls = step.forward_loss, []

    def poisoned(*args, **kwargs):
        parts = original(*args, **kwargs)
        calls.append(1)
        if (len(calls) - 1) // 2 + 1 in bad_steps:
            nan = torch.tensor(float("nan"))
            parts = parts._replace(total=parts.total * nan, lm_sum=parts.lm_sum * nan)
        return parts

    monkeypatch.setattr(step, "forward_loss", poisoned)


def _weights(out, step):
    from genome_lm.checkpoint import read_weights

    tensors = read_weights(out / "checkpoints" / f"step-{step:06d}")
    return {k: v for k, v in tensors.items() if not k.endswith("expert_bias")}  # parameters only


def _notes(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "genome_lm.train.trainer"]


def test_nonfinite_steps_are_skipped_and_three_in_a_row_stop(small_dataset, tmp_path, monkeypatch, caplog):
    """nonfinite = skip: a NaN step leaves the parameters alone and training goes on; a good step
    resets the count; the third NaN step in a row stops. Each is reported without a progress bar."""
    import torch

    _poison_steps(monkeypatch, {2, 4, 5, 6})
    out = tmp_path / "nan"
    result = train(_config(small_dataset, out, steps=8, extra=["train.save_every=1"]), progress=False)
    before, skipped, after = _weights(out, 1), _weights(out, 2), _weights(out, 3)
    assert all(torch.equal(before[k], skipped[k]) for k in before)  # step 2 changed nothing
    assert not all(torch.equal(skipped[k], after[k]) for k in before)  # step 3 trained
    assert [m.skipped for m in result.history] == [False, True, False, True, True, True]
    assert result.steps_done == 6 and result.stopped_by == "non-finite loss"
    assert math.isnan(result.history[1].lm_loss) and math.isfinite(result.history[2].lm_loss)
    notes = _notes(caplog)
    assert [n.split(":")[0] for n in notes if "update skipped" in n] == ["step 2", "step 4", "step 5", "step 6"]
    assert [n for n in notes if n.startswith("stopping")] == ["stopping after step 6: non-finite loss (3 in a row)"]


def test_nonfinite_stop_stops_at_the_first(small_dataset, tmp_path, monkeypatch, caplog):
    _poison_steps(monkeypatch, {2})
    result = train(_config(small_dataset, tmp_path / "stop", steps=4, extra=["train.nonfinite=stop"]),
                   progress=False)
    assert result.steps_done == 2 and result.stopped_by == "non-finite loss"
    assert [m.skipped for m in result.history] == [False, True]
    assert _notes(caplog) == [n for n in _notes(caplog) if n.startswith(("step 2:", "stopping"))]
    assert "stopping after step 2: non-finite loss (train.nonfinite = stop)" in _notes(caplog)
    assert sum("update skipped" in n for n in _notes(caplog)) == 1


RANK = textwrap.dedent("""
    import json, os, sys
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    from genome_lm.config import load_config
    from genome_lm.train.trainer import train
    result = train(load_config("demo-cpu", json.loads(sys.argv[1])), progress=False)
    print(json.dumps({"steps": result.steps_done, "stopped_by": result.stopped_by}))
""")


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_the_same_step(small_dataset, tmp_path):
    """Two data-parallel ranks (gloo); only rank 1 gets SIGTERM. Both stop after the same step,
    write one complete checkpoint and exit 0 (deciding per rank, they deadlocked in its collectives)."""
    from genome_lm.checkpoint import latest_checkpoint, verify
    from genome_lm.engine.parallel import free_port

    out = tmp_path / "two"
    args = [f"data.dataset={small_dataset}", "train.steps=200", "data.seq_len=128", "train.global_batch_size=2",
            "model.kernel_backend=torch", f"train.out_dir={out}", "train.save_every=2", "train.indexer_dense_steps=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, json.dumps(args)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.time() + 300
        while time.time() < deadline and not latest.exists() and all(r.poll() is None for r in ranks):
            time.sleep(0.05)
        assert latest.exists(), ranks[0].communicate()[1][-3000:]
        ranks[1].send_signal(signal.SIGTERM)
        done = [r.communicate(timeout=120) for r in ranks]
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait()
    for rank, (proc, (stdout, stderr)) in enumerate(zip(ranks, done)):
        assert proc.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
    reports = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in done]
    assert reports[0] == reports[1] and reports[0]["stopped_by"] == "SIGTERM"
    steps = reports[0]["steps"]
    assert 2 <= steps < 200
    folder = latest_checkpoint(out)
    assert folder.name == f"step-{steps:06d}"
    meta = verify(folder)  # every file of both ranks present, with its recorded size and checksum
    assert meta["world_size"] == 2 and {"state-r00000.json", "state-r00001.json"} <= set(meta["files"])


@pytest.mark.parametrize("override,message", [("train.global_batch_size=3", "multiple of micro_batch_size"),
                                              ("data.seq_len=4096", "seq_len")])
def test_bad_settings_are_errors(small_dataset, tmp_path, override, message):
    from genome_lm.errors import GenomeLMError

    with pytest.raises(GenomeLMError, match=message):
        train(_config(small_dataset, tmp_path / "x", extra=[override, "train.micro_batch_size=2"]
                      if "global" in override else [override]), progress=False)


@pytest.mark.slow
def test_export_writes_the_trained_weights_as_hugging_face(small_dataset, tmp_path):
    import torch

    from genome_lm.checkpoint.huggingface import HFCheckpoint, hf_keys
    from genome_lm.model import get_preset
    from genome_lm.train.export import export_run

    result = train(_config(small_dataset, tmp_path / "run", steps=2), progress=False)
    export_run(tmp_path / "run", tmp_path / "hf")
    ckpt = HFCheckpoint(tmp_path / "hf")
    assert ckpt.config() == get_preset("tiny")
    from genome_lm.checkpoint import read_weights

    trained = read_weights(result.checkpoint)
    name = "layers.3.self_attention.q_b_proj.weight"
    assert torch.equal(ckpt.get(hf_keys(name, ckpt.config(), ckpt.prefix)[0]), trained[name])
    name = "layers.1.mlp.experts.local_experts.5.linear_fc2.weight"
    assert torch.equal(ckpt.get(hf_keys(name, ckpt.config(), ckpt.prefix)[0]), trained[name])


@pytest.mark.slow
def test_pretrained_checkpoint_with_its_own_vocabulary(small_dataset, tmp_path):
    """Start from a glm5_next checkpoint whose vocabulary is text: bases train as its letters."""
    from tests.data.test_vocab import write_tokenizer
    from tests.model.hf_oracle import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "hf", text={"vocab_size": 64}, seed=1)
    write_tokenizer(ckpt, {"<unk>": 0, "A": 40, "C": 41, "G": 50, "T": 33, "N": 60})
    cfg = _config(small_dataset, tmp_path / "run", steps=2, extra=[f"model.checkpoint={ckpt}"])
    result = train(cfg, progress=False)
    assert result.steps_done == 2
    # the first step's loss, recomputed by hand: the checkpoint's weights on the mapped letters
    import torch

    from genome_lm.checkpoint import build
    from genome_lm.data.loader import TrainLoader
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.train.loss import lm_loss

    loader = TrainLoader(str(small_dataset), "train", seq_len=256, micro_batch_size=1, softmask_weight=0.1,
                         reverse_complement=cfg.data.reverse_complement, seed=cfg.train.seed)
    batches = [loader.next_batch(), loader.next_batch()]
    table = torch.tensor([0, 0, 0, 0, 40, 41, 50, 33, 60])
    with parallel_context() as pg, torch.no_grad():
        model = build(cfg, pg, ParallelSizes())
        weight = sum(b.loss_weight.sum() for b in batches)
        total = sum(lm_loss(model(table[b.tokens]).logits, table[b.labels.clamp_min(0)], b.loss_weight,
                            global_weight=weight).lm for b in batches)
        unmapped = sum(lm_loss(model(b.tokens).logits, b.labels.clamp_min(0), b.loss_weight,
                               global_weight=weight).lm for b in batches)
    assert result.history[0].lm_loss == pytest.approx(float(total), rel=1e-5)
    assert abs(float(unmapped) - float(total)) > 1e-3
    # a new run from this run: the tokenizer is found through its meta.json's model.checkpoint
    from genome_lm.checkpoint import token_map

    again = _config(small_dataset, tmp_path / "run2", steps=1, extra=[f"model.checkpoint={tmp_path / 'run'}"])
    with parallel_context() as pg:
        model = build(again, pg, ParallelSizes())
        assert torch.equal(token_map(again, model), table)
    assert train(again, progress=False).steps_done == 1


def test_sequence_length_warmup(small_dataset, tmp_path):
    cfg = _config(small_dataset, tmp_path / "w", steps=3, extra=["data.seq_len_warmup=[[0, 128], [2, 256]]"])
    result = train(cfg, progress=False)
    assert [m.tokens for m in result.history] == [2 * 128, 2 * 128, 2 * 256]


def test_loss_chunk_trains_like_the_whole_loss(small_dataset, tmp_path):
    """memory.loss_chunk runs the output layer and loss in blocks inside train(): same losses."""
    whole = train(_config(small_dataset, tmp_path / "whole", steps=2), progress=False)
    chunked = train(_config(small_dataset, tmp_path / "chunked", steps=2, extra=["memory.loss_chunk=100"]),
                    progress=False)
    for a, b in zip(whole.history, chunked.history, strict=True):
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-6)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
