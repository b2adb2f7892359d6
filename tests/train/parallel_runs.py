"""What the multi-worker training tests share: a start checkpoint both runs load, the common
overrides, and the check that a parallel run's history is the one-process run's."""

import pytest
import torch


def tiny_checkpoint(out, cfg=None):
    """Random weights of the tiny model (or ``cfg``) as a Hugging Face checkpoint: random
    initialisation under a split model draws other weights, so both runs start from this."""
    from genome_lm.checkpoint.huggingface import export_hf_checkpoint
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model

    with parallel_context() as pg:
        torch.manual_seed(0)
        export_hf_checkpoint(build_model(cfg or get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch"), out)
    return out


def overrides(dataset, ckpt, *, seq_len: int, batch: int, lr: str = "1e-2", extra=()) -> list[str]:
    return [f"data.dataset={dataset}", "train.steps=3", f"data.seq_len={seq_len}", f"train.global_batch_size={batch}",
            "model.kernel_backend=torch", "train.indexer_dense_steps=1", f"train.lr={lr}",
            f"model.checkpoint={ckpt}", *extra]


def assert_same_history(one, two, *, tokens: int | None = None, moe: bool = False) -> None:
    """Step by step: the same tokens, LM loss (rel 1e-5), indexer loss (rel 1e-4, or 3e-8 absolute:
    a KL divergence of ~1e-4 that falls to ~1e-5, so its float rounding is absolute; a one-process
    run computes the dense loss with the C kernel and a tensor-parallel run with the torch path,
    whose fp32 sums run in another order: measured 1.4e-8 apart at 1.3e-4) and gradient norm (rel
    1e-4); with ``moe`` also the MoE auxiliary loss and the busiest-expert ratio."""
    assert len(one.history) == len(two.history)
    for a, b in zip(one.history, two.history, strict=True):
        assert b.tokens == a.tokens and (tokens is None or a.tokens == tokens)
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5)
        assert b.indexer_loss == pytest.approx(a.indexer_loss, rel=1e-4, abs=3e-8)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        if moe:
            assert b.moe_aux_loss == pytest.approx(a.moe_aux_loss, rel=1e-5)
            assert b.moe_max_over_mean == pytest.approx(a.moe_max_over_mean, rel=1e-6)
