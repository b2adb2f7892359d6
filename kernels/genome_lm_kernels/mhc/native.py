"""mHC in C (``cpu/mhc.c``): the Sinkhorn normalisation forward and backward on token-last
matrices, and the two per-token products (collapse, merge) as autograd functions whose backward
is one pass per token too. fp32 CPU tensors; tokens split over torch's threads."""

from __future__ import annotations

import torch

from genome_lm_kernels.cpu import native


def takes(*tensors: torch.Tensor) -> bool:
    """Inputs the C kernels take: every one fp32 on the CPU."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _run_tokens(fn: str, tokens: int, args_for) -> None:
    """``cpu/mhc.c``'s ``fn`` over ``tokens`` tokens, split over torch's threads; ``args_for(m0, m1)``."""
    native.run_rows(getattr(native.library("mhc"), fn), native.split_rows(tokens), lambda i, m0, m1: args_for(m0, m1))


def sinkhorn_c(fn: str, z: torch.Tensor, grad: torch.Tensor | None, iters: int, eps: float) -> torch.Tensor:
    """The Sinkhorn forward (``grad`` None) or its gradient at z; matches ``sinkhorn.steps`` /
    ``sinkhorn.grad``."""
    from .recompute import tokens_last

    n = z.shape[-1]
    zt = tokens_last(z)
    args = (zt,) if grad is None else (zt, tokens_last(grad.float()))
    M = zt.shape[-1]
    out = torch.empty_like(zt)
    ptrs = [native.ptr(a) for a in args]
    _run_tokens(fn, M, lambda m0, m1: (*ptrs, M, n, iters, eps, m0, m1, native.ptr(out)))
    return out.permute(2, 0, 1).reshape(z.shape).contiguous()


class Collapse(torch.autograd.Function):
    """sum_n pre[n] * streams[n]: pre [.., N] and streams [.., N, D] fp32 -> [.., D]."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        pre, streams = native.f32(pre), native.f32(streams)
        ctx.save_for_backward(pre, streams)
        N, D = streams.shape[-2:]
        x = streams.new_empty(streams.shape[:-2] + (D,))
        _run_tokens("mhc_collapse_fwd", pre.numel() // N, lambda m0, m1: (
            native.ptr(pre), native.ptr(streams), N, D, m0, m1, native.ptr(x)))
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        pre, streams = ctx.saved_tensors
        g = native.f32(g)
        N, D = streams.shape[-2:]
        dpre, ds = torch.empty_like(pre), torch.empty_like(streams)
        _run_tokens("mhc_collapse_bwd", pre.numel() // N, lambda m0, m1: (
            native.ptr(pre), native.ptr(streams), native.ptr(g), N, D, m0, m1, native.ptr(dpre), native.ptr(ds)))
        return dpre, ds


class Merge(torch.autograd.Function):
    """post [.., N], comb [.., N, N], block_out [.., D] and streams [.., N, D], all fp32 -> the new
    streams [.., N, D]."""

    @staticmethod
    def forward(ctx, post, comb, block_out, streams):
        post, comb, block_out, streams = (native.f32(t) for t in (post, comb, block_out, streams))
        ctx.save_for_backward(post, comb, block_out, streams)
        N, D = streams.shape[-2:]
        out = torch.empty_like(streams)
        _run_tokens("mhc_merge_fwd", post.numel() // N, lambda m0, m1: (
            *(native.ptr(t) for t in (post, comb, block_out, streams)), N, D, m0, m1, native.ptr(out)))
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        post, comb, block_out, streams = ctx.saved_tensors
        g = native.f32(g)
        N, D = streams.shape[-2:]
        grads = [torch.empty_like(t) for t in (post, comb, block_out, streams)]
        _run_tokens("mhc_merge_bwd", post.numel() // N, lambda m0, m1: (
            *(native.ptr(t) for t in (post, comb, block_out, streams, g)), N, D, m0, m1,
            *(native.ptr(t) for t in grads)))
        return tuple(grads)
