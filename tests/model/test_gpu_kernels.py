"""The whole tiny model on the GPU kernel backends (run on CPU tensors under Triton's interpreter):
KDA through the tiled Triton kernels, the DSA layers in absorbed MLA form through the sparse MLA
kernels, the indexer's scores through its Triton kernel. ``triton-fp32`` gives the torch
backend's logits, indexer loss and every gradient; ``triton`` (bf16 tensor-core products) its
logits within the bf16 bound. The torch paths are made to raise, so nothing falls back."""

from __future__ import annotations

import pytest
import torch

from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model.model import build_model
from genome_lm.model.presets import get_preset

T = 130  # two KDA chunks, one ragged; the tiny preset's top-k (256 tokens) selects every visible pool


def _run(backend, monkeypatch=None):
    # the full model's initializer_range (0.02), at which the bf16 bound below was set: at the tiny-long
    # preset's 0.125 the tensor-core path's logits differ by 0.18 relative (issue 17's note: not
    # yet explained, to be found before this is relaxed)
    cfg = get_preset("tiny").replace(initializer_range=0.02)
    with parallel_context() as pg:
        torch.manual_seed(0)
        model = build_model(cfg, pg, ParallelSizes(), kernel_backend=backend)
        absorbed = [m.absorbed for m in model.modules() if hasattr(m, "absorbed")]
        ids = torch.randint(0, 5, (1, T + 1), generator=torch.Generator().manual_seed(1))
        out = model(ids[:, :-1], indexer_loss="sparse")
        loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), ids[0, 1:])
        (loss + sum(out.indexer_losses)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), [x.item() for x in out.indexer_losses], grads, absorbed


def _no_torch_paths(monkeypatch):
    import importlib

    from genome_lm_kernels.dsa import indexer, mla
    from genome_lm_kernels.kda import chunked

    sparse_attention = importlib.import_module("genome_lm_kernels.dsa.sparse_attention")  # the module, not the op

    def refuse(*args, **kwargs):
        raise AssertionError("a GPU backend ran a torch path")

    monkeypatch.setattr(chunked, "kda_chunked", refuse)
    monkeypatch.setattr(mla, "sparse_mla_forward", refuse)
    monkeypatch.setattr(sparse_attention, "SparseAttention", refuse)
    monkeypatch.setattr(indexer, "torch_scores", refuse)


@pytest.fixture(scope="module")
def torch_run():
    return _run("torch")


@pytest.mark.slow
def test_fp32_kernels_give_the_torch_model(torch_run, monkeypatch):
    logits, idx_losses, grads, absorbed = torch_run
    assert absorbed and not any(absorbed)  # the CPU path attends per head
    _no_torch_paths(monkeypatch)
    got_logits, got_losses, got_grads, got_absorbed = _run("triton-fp32")
    assert all(got_absorbed)
    torch.testing.assert_close(got_logits, logits, rtol=2e-5, atol=2e-5)
    assert got_losses == pytest.approx(idx_losses, rel=1e-4)
    assert got_grads.keys() == grads.keys()
    for name, g in grads.items():
        err = float((got_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-8))
        assert err < 1e-3, (name, err)


@pytest.mark.slow
def test_tensor_core_kernels_within_bf16_bound(torch_run, monkeypatch):
    """Gradients are not compared: bf16 products flip MoE routing decisions (top-k), which moves
    expert gradients by more than rounding; the fp32 mode above checks the gradient path."""
    logits, *_ = torch_run
    _no_torch_paths(monkeypatch)
    got_logits, _, grads, _ = _run("triton")
    err = float((got_logits - logits).norm() / logits.norm())
    assert err < 2e-2, err
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
