"""``parallel.overlap_grad_reduce``: megatron-core DDP reduces each gradient bucket during the
last micro-batch's backward instead of after the step's backward. Two data-parallel gloo ranks,
two micro-batches each: the same losses, gradient norms and weights as the run without overlap,
and the reductions really are dispatched inside backward (after the first step, in which
megatron-core learns how many gradients each parameter gets in a step), once per bucket a step.
Under pipeline parallel the 1F1B schedule's backward passes take the same path."""

import json
from pathlib import Path

import pytest
import torch

from genome_lm.checkpoint import latest_checkpoint, read_weights
from tests.workers import run_workers

WORKER = Path(__file__).with_name("overlap_worker.py")


def _run(dataset, out: Path, *, overlap: bool, extra=()) -> dict:
    sets = [f"data.dataset={dataset}", "train.steps=3", "data.seq_len=256", "train.global_batch_size=4",
            "model.kernel_backend=torch", "train.indexer_dense_steps=1", "train.lr=1e-2", f"train.out_dir={out}",
            f"parallel.overlap_grad_reduce={str(overlap).lower()}", *extra]
    run_workers(WORKER, 2, {"sets": sets, "out": str(out / "result.json")})
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("parallel.pp=2",)], ids=["dp2", "pp2"])
def test_overlapped_reduction_gives_the_same_training(small_dataset, tmp_path, extra):
    plain = _run(small_dataset, tmp_path / "plain", overlap=False, extra=extra)
    overlapped = _run(small_dataset, tmp_path / "overlap", overlap=True, extra=extra)
    assert len(plain["history"]) == len(overlapped["history"]) == 3
    for a, b in zip(plain["history"], overlapped["history"]):
        assert b["tokens"] == a["tokens"]
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-6)
        assert b["indexer_loss"] == pytest.approx(a["indexer_loss"], rel=1e-5, abs=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    one = read_weights(latest_checkpoint(tmp_path / "plain"))
    two = read_weights(latest_checkpoint(tmp_path / "overlap"))
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-7, msg=key)
    # without overlap every reduction follows backward; with it, from the second step on, every
    # one is dispatched from a gradient hook inside the last micro-batch's backward
    assert plain["dispatches"] and not any(inside for _, inside in plain["dispatches"])
    later = [inside for step, inside in overlapped["dispatches"] if step > 0]
    assert later and all(later)
    per_step = [sum(1 for step, _ in overlapped["dispatches"] if step == s) for s in range(3)]
    assert per_step[1] == per_step[2] == per_step[0]  # each bucket group once a step


def test_shared_expert_overlap_reaches_megatron_on_the_gpu_profile_and_is_refused_on_cpu(monkeypatch):
    """The switch becomes megatron-core's ``moe_shared_expert_overlap`` with the GPU profile's
    all-to-all dispatcher; on the CPU profile (allgather dispatcher, no CUDA streams) building the
    model stops with a one-line error naming the setting."""
    import dataclasses

    from genome_lm.engine import backend as engine_backend
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.errors import GenomeLMError
    from genome_lm.model import get_preset
    from genome_lm.model.common import BuildOptions, megatron_config
    from genome_lm.model.model import build_model

    cfg, sizes = get_preset("tiny"), ParallelSizes(moe_shared_expert_overlap=True)
    gpu = dataclasses.replace(engine_backend.profile(gpu=False), moe_dispatcher="alltoall")
    monkeypatch.setattr(engine_backend, "current", lambda: gpu)
    tf = megatron_config(cfg, sizes, BuildOptions(shared_expert_overlap=True))
    assert tf.moe_shared_expert_overlap and tf.moe_token_dispatcher_type == "alltoall"
    assert not megatron_config(cfg, sizes, BuildOptions()).moe_shared_expert_overlap
    monkeypatch.undo()
    with parallel_context() as pg, pytest.raises(GenomeLMError, match="moe_shared_expert_overlap.*allgather"):
        build_model(cfg, pg, sizes, kernel_backend="torch")
