"""The step's FLOP count (genome_lm.model.flops) against torch's own counter on a real training
step of the tiny model (the trainer's ``train.step``): every matrix product torch runs, counted by
``torch.utils.flop_counter.FlopCounterMode``, against the count made from the config alone.

FlopCounterMode has no formula for the in-place ``baddbmm_`` (the CPU sparse attention's dk and
dv accumulation in dense blocks): the test registers the out-of-place one for it. Convolutions
are left out on both sides (the KDA short convolution is depthwise, elementwise work; torch's
counter also counts its backward as a dense convolution, 190x too much).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from genome_lm.config import load_config
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model import flops
from genome_lm.plan import measure
from genome_lm.plan.memory_model import model_config, with_changes


def _baddbmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.bmm_flop(a_shape, b_shape)


def measured_matmul_flops(run) -> int:
    """Matrix-product FLOPs of one training step of ``run`` (the trainer's step,
    ``train.step.forward_backward``, as the planner's measurement runs it), as torch counts them:
    on the torch path (the count models its products; the C kernels for the CPU do the same
    arithmetic where torch's counter cannot see it)."""
    with pytest.MonkeyPatch.context() as mp, parallel_context() as pg:
        mp.setenv("GENOME_LM_NATIVE", "0")
        model = measure.build_measured(run, pg, ParallelSizes())
        micro = measure.random_batches(run, 1)
        counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: _baddbmm_inplace})
        with counter:
            measure.train_step(model, run, micro)
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if "convolution" not in str(op))


def predicted(run) -> float:
    work = flops.step_work(model_config(run), run.memory, T=run.data.seq_len, batch=run.train.micro_batch_size,
                           indexer_loss_mode=run.train.indexer_loss)
    return flops.total(work, "matmul")


CASES = [
    # (length, indexer loss, memory changes, batch): 2,500 passes the CPU sparse attention's
    # dense-block bound (8 x 259 keys), so its later blocks gather (vector work, not counted)
    pytest.param(300, "off", {}, 1, id="T300-off"),
    pytest.param(1024, "sparse", {}, 1, id="T1024-sparse"),
    pytest.param(777, "dense", {"recompute": "full"}, 1, id="T777-dense-full"),
    pytest.param(1000, "sparse", {"recompute": "full", "loss_chunk": 256}, 1, id="T1000-sparse-full-losschunk"),
    pytest.param(640, "dense", {"recompute": "selective", "recompute_modules": ["attention", "moe"]}, 2,
                 id="T640-dense-selective-B2"),
    pytest.param(2500, "sparse", {}, 1, marks=pytest.mark.slow, id="T2500-sparse"),
    pytest.param(1536, "off", {"recompute": "full", "recompute_nested": True, "moe_chunks": 2,
                               "moe_chunk_recompute": True, "dsa_keep_selection": False}, 1,
                 marks=pytest.mark.slow, id="T1536-nested-moechunks-noselection"),
]


@pytest.mark.parametrize("T, mode, memory, batch", CASES)
def test_flop_count_matches_torch_counter(T, mode, memory, batch):
    run = with_changes(load_config("demo-cpu"), data={"seq_len": T}, memory=memory,
                       train={"indexer_loss": mode, "micro_batch_size": batch})
    measured = measured_matmul_flops(run)
    ratio = predicted(run) / measured
    # the issue's bound is 5%; the count is exact up to a few boundary products (measured
    # within 0.3%), so hold it to 1%
    assert abs(ratio - 1) < 0.01, f"predicted / measured = {ratio:.4f}"


def test_count_grows_with_what_the_step_does():
    """Each switch moves the count the way the code does (no measurement: the rules themselves)."""
    cfg = model_config(load_config("demo-cpu"))
    mem = load_config("demo-cpu").memory
    base = flops.total(flops.step_work(cfg, mem, T=4096))
    full = flops.total(flops.step_work(cfg, mem.model_copy(update={"recompute": "full"}), T=4096))
    fwd = sum(w.count * w.forward for w in flops.step_work(cfg, mem, T=4096, head=False)
              if w.name != "DSA indexer selection")
    merges = cfg.num_hidden_layers * 2.0 * 4096 * cfg.hc_mult**2 * cfg.hidden_size
    # the layers' forward once more, but for the kept selection and each layer's last merge
    # product (torch's checkpoint stops replaying once every saved tensor is back)
    assert full - base == pytest.approx(fwd - merges)
    # the indexer's selection is O(T^2 / kpool): four times the work at twice the length, and more
    sel = [flops.dsa_selection(cfg, T, 1, 64).forward for T in (8192, 16384)]
    assert sel[1] / sel[0] == pytest.approx(4, rel=0.02)


def test_per_gpu_split():
    cfg = model_config(load_config("glm-5.3-flash-1m-64xb200"))
    mem = load_config("glm-5.3-flash-1m-64xb200").memory
    work = flops.step_work(cfg, mem, T=65536, gpu=True, indexer_loss_mode="sparse")
    one = flops.per_gpu(work, flops.Parallel())
    assert one == pytest.approx(flops.total(work))
    split = flops.per_gpu(work, flops.Parallel(tp=8, cp=2, sequence_parallel=True))
    whole = sum(w.total for w in work if w.split == "whole")
    queries = sum(w.total for w in work if w.split == "queries")  # the DSA selection and loss scores
    tokens = sum(w.total for w in work if w.split == "tokens")  # low-rank projections: over cp only
    assert {w.name for w in work if w.split == "queries"} == {"DSA indexer selection", "DSA indexer loss scores"}
    assert split == pytest.approx(whole + queries + tokens / 2 + (one - whole - queries - tokens) / 16)
    shared = flops.per_gpu(work, flops.Parallel(tp=8, cp=2, sequence_parallel=True, share_queries=True))
    assert split - shared == pytest.approx(queries * 15 / 16)  # shared out: 1/16 of it on each GPU
    busiest = flops.per_gpu(work, flops.Parallel(tp=8, cp=2, sequence_parallel=True, moe_imbalance=4))
    experts = sum(w.total for w in work if w.split == "experts")
    assert busiest - split == pytest.approx(3 * experts / 16)


def test_model_flops_per_token_of_the_published_model():
    """6 x the active parameters: about 18B for GLM-5.3-Flash (docs/design.md, section 2), less the
    input embedding, which is a lookup."""
    cfg = model_config(load_config("glm-5.3-flash-1m-64xb200"))
    active = flops.model_flops_per_token(cfg) / 6
    assert 16e9 < active < 18e9
