"""A LoRA step's FLOPs (``genome_lm.plan.peft.lora_work``) against torch's counter on the trainer's
step of the tiny model (as tests/plan/test_flops.py for full fine-tuning; a module of its own:
the measurement opens its own process groups)."""

from __future__ import annotations

import pytest

from genome_lm.config import load_config
from genome_lm.model import flops
from genome_lm.plan import peft as P
from genome_lm.plan.memory_model import inert_layers, model_config, with_changes

from .test_flops import measured_matmul_flops


def _predicted(run) -> float:
    cfg = model_config(run)
    T, B = run.data.seq_len, run.train.micro_batch_size
    work = flops.step_work(cfg, run.memory, T=T, batch=B, indexer_loss_mode=run.train.indexer_loss)
    work, _ = P.lora_work(work, cfg, run, T=T, batch=B, gpu=False, a=4, inert=inert_layers(run, cfg, 4))
    return flops.total(work, "matmul")


@pytest.mark.parametrize("T, mode, memory, peft", [
    pytest.param(1024, "sparse", {}, {"train": ["embedding.weight"]}, id="T1024-sparse"),
    pytest.param(777, "dense", {"recompute": "full"}, {"train": ["embedding.weight"]}, id="T777-dense-full"),
    pytest.param(1000, "sparse", {"recompute": "full", "loss_chunk": 256},
                 {"targets": ["*.o_proj", "output_layer", "*.indexer.wq_b"],
                  "train": ["embedding.weight", "*.router.weight", "*.attn_hc.fn", "*.kv_b_proj.weight",
                            "layers.3.mlp.experts.local_experts.2.linear_fc1.weight"]},
                 marks=pytest.mark.slow, id="T1000-mixed-full-losschunk"),
    pytest.param(640, "dense", {"recompute": "selective", "recompute_modules": ["attention", "moe"]},
                 {"train": ["embedding.weight"], "dropout": 0.1}, marks=pytest.mark.slow, id="T640-selective-dropout"),
])
def test_lora_flops_match_torch_counter(T, mode, memory, peft):
    """A LoRA step's matrix products (frozen projections: the input's gradient only; trained
    ones: both; the adapters' thin products; nothing for a frozen indexer's loss) against
    torch's count of the trainer's step. With the embedding trained, so that every layer's input
    needs a gradient (without it the first layers do less: below)."""
    run = with_changes(load_config("demo-cpu"), data={"seq_len": T}, memory=memory, train={"indexer_loss": mode},
                       peft={"method": "lora", **peft})
    ratio = _predicted(run) / measured_matmul_flops(run)
    assert abs(ratio - 1) < 0.01, f"predicted / measured = {ratio:.4f}"


def test_lora_flops_are_an_upper_bound_before_the_first_trained_input():
    """With the embedding frozen, the first layer's projections before its adapters compute no
    gradient at all; the plan counts their input gradients (within 5% on the 4-layer model, one
    layer in 45 on the published one); the layers before the first adapter run no backward."""
    for peft in ({}, {"rank": 4, "targets": ["layers.2.*_proj", "layers.3.self_attention.[qo]*proj"]}):
        run = with_changes(load_config("demo-cpu"), data={"seq_len": 1024}, train={"indexer_loss": "sparse"},
                           peft={"method": "lora", **peft})
        ratio = _predicted(run) / measured_matmul_flops(run)
        assert 1.0 <= ratio < 1.05, f"predicted / measured = {ratio:.4f}"
