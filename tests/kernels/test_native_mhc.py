"""mHC's per-token products in C (``genome_lm_kernels/cpu/mhc.c``: the block's input, collapse, and
the merge into new streams) against the torch formulas of ``HyperConnection`` in float64, forward
and every gradient, on fresh random inputs: uneven token counts, N = 4 with D = 64 (the presets'
own compiled loops) and other shapes, tokens split over threads, outputs poisoned with NaN."""

from __future__ import annotations

import importlib

import pytest
import torch

from genome_lm.model.common import HyperConnection
from genome_lm_kernels import resolve_backend
from genome_lm_kernels.cpu import native

mhc_native = importlib.import_module("genome_lm_kernels.mhc.native")


SHAPES = [(37, 3, 4, 64), (5, 1, 4, 64), (29, 2, 3, 20), (1, 1, 2, 7)]  # S, B, N, D


def _collapse_torch(pre, streams):
    return (pre.unsqueeze(-1) * streams).sum(-2)


def _merge_torch(post, comb, block_out, streams):
    return post.unsqueeze(-1) * block_out.unsqueeze(-2) + comb.transpose(-1, -2) @ streams


def _inputs(generator, S, B, N, D):
    def r(*shape):
        return torch.randn(*shape, generator=generator)

    return dict(pre=torch.rand(S, B, N, generator=generator) + 1e-6, post=2 * torch.rand(S, B, N, generator=generator),
                comb=torch.softmax(r(S, B, N, N), -1), block_out=r(S, B, D), streams=r(S, B, N, D))


def _check(got_fn, ref_fn, tensors, upstream_shape, generator, tol=2e-5):
    """Forward and input gradients of got_fn (fp32, C) against ref_fn in fp64 on the same inputs."""
    xs = [t.clone().requires_grad_() for t in tensors]
    ref_xs = [t.double().requires_grad_() for t in tensors]
    up = torch.randn(upstream_shape, generator=generator)
    got = got_fn(*xs)
    ref = ref_fn(*ref_xs)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad(got, xs, up)
    ref_grads = torch.autograd.grad(ref, ref_xs, up.double())
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert torch.isfinite(a).all(), f"input {i}: unwritten (NaN) gradient elements"
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=lambda m: f"input {i}: {m}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("S,B,N,D", SHAPES)
def test_collapse_and_merge_match_the_torch_formulas(generator, nan_poison, monkeypatch, threads, S, B, N, D):
    monkeypatch.setattr(native, "MIN_ROWS_PER_THREAD", 1)  # split even a few tokens over the threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x = _inputs(generator, S, B, N, D)
    _check(mhc_native.Collapse.apply, _collapse_torch, [x["pre"], x["streams"]], (S, B, D), generator)
    _check(mhc_native.Merge.apply, _merge_torch, [x["post"], x["comb"], x["block_out"], x["streams"]], (S, B, N, D),
           generator)


def test_hyper_connection_runs_the_c_path_and_matches_torch(generator, monkeypatch):
    """A whole HyperConnection (pre, Sinkhorn, collapse) and merge, C against GENOME_LM_NATIVE=0,
    with the same weights: the new streams and the gradients agree, and the C path did run."""
    from genome_lm.model.presets import get_preset

    cfg = get_preset("tiny")
    torch.manual_seed(0)
    hc = HyperConnection(cfg, resolve_backend("torch", "cpu"))
    streams = torch.randn(50, 2, cfg.hc_mult, cfg.hidden_size, generator=generator)
    block_out = torch.randn(50, 2, cfg.hidden_size, generator=generator)
    runs = {}
    for path in ("C", "torch"):
        hc.backend = resolve_backend("torch", "cpu", native=path == "C")
        calls = []
        for name in ("Collapse", "Merge"):
            cls = getattr(mhc_native, name)
            monkeypatch.setattr(cls, "apply", lambda *a, f=cls.apply, n=name: calls.append(n) or f(*a))
        hc.zero_grad()
        s = streams.clone().requires_grad_()
        post, comb, x = hc(s)
        new = hc.merge(post, comb, torch.tanh(x) + block_out, s)
        (new.square().sum() + x.sum()).backward()
        runs[path] = (new.detach(), s.grad, *(p.grad.clone() for p in hc.parameters()), calls)
        monkeypatch.undo()
    assert runs["C"][-1] == ["Collapse", "Merge"] and runs["torch"][-1] == []
    # fp32 both ways, summed in other orders: measured 0.5-1.5e-7 of each tensor's norm (the
    # parameters' gradients sum 100 tokens' terms of up to 1e4)
    for name, a, b in zip(["streams", "streams grad", "fn grad", "base grad", "scale grad"], runs["C"], runs["torch"]):
        assert ((a - b).norm() / b.norm()).item() < 1e-6, name
