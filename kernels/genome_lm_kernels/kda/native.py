"""KDA's CPU path in C (``cpu/kda.c``): the token recurrence of ``reference.py``, forward and a
hand-written backward, for small heads.

A token is about 4 K V multiply-adds on a state that stays in cache; the chunked torch path
(``chunked.py``) turns the same work into matrix products over chunks of 64 tokens, which pays
for large heads (MKL's products) and costs ~100 small tensor ops per group for small ones
(measured: ``MAX_STATE``). Forward keeps the
state entering every 64 tokens (K V floats each); backward recomputes each block of 64 from there.
"""

from __future__ import annotations

import torch

from genome_lm_kernels.cpu import native

# The largest state (K * V floats a head) the C recurrence takes. Forward + backward on 2 cores,
# 2,048 tokens, C against chunked torch: K = V = 16 (4 heads) 3.6 against 15.0 ms, 32 (4 heads)
# 15.9 against 26.0, 64 (2 heads) 16.9 against 31.1, 128 (1 head) 35.4 against 30.6: the full
# model's 128 x 128 heads stay on the chunked path, whose matrix products batch a token's work.
MAX_STATE = 64 * 64
BLOCK = 64  # tokens per saved state: cpu/kda.c's BT


def runs_in_c(K: int, V: int) -> bool:
    """Whether heads of K x V take the C recurrence (with a backend whose ``native`` is on): a
    state of at most ``MAX_STATE`` floats."""
    return K * V <= MAX_STATE


def applies(q: torch.Tensor, v: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether the C recurrence takes these inputs: CPU, not fp64 (the precision reference stays on
    torch), and ``runs_in_c`` for their heads."""
    return native.usable(q, v, *inputs) and runs_in_c(q.shape[-1], v.shape[-1])


class _KDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, scale: float):
        q, k, v, g, beta = (native.f32(x) for x in (q, k, v, g, beta))
        S0 = None if S0 is None else native.f32(S0)
        B, T, H, K = q.shape
        V = v.shape[-1]
        f32 = dict(dtype=torch.float32)
        o = torch.empty(B, T, H, V, **f32)
        S_final = torch.empty(B, H, K, V, **f32)
        blocks = torch.empty(B * H, -(-T // BLOCK), K, V, **f32) if any(ctx.needs_input_grad) else None
        lib = native.library("kda")
        ptrs = [native.ptr(x) for x in (q, k, v, g, beta)]
        s0 = native.ptr(S0)
        native.run_rows(lib.kda_fwd, native.split_rows(B * H, 1), lambda i, r0, r1: (
            *ptrs, scale, s0, B, T, H, K, V, r0, r1, native.ptr(o), native.ptr(S_final),
            native.ptr(blocks)))
        ctx.save_for_backward(q, k, v, g, beta, blocks)
        ctx.scale, ctx.has_S0 = scale, S0 is not None
        return o, S_final

    @staticmethod
    def backward(ctx, do, dS_final):
        q, k, v, g, beta, blocks = ctx.saved_tensors
        B, T, H, K = q.shape
        V = v.shape[-1]
        do = native.f32(do) if do is not None else torch.zeros(B, T, H, V, dtype=torch.float32)
        dS_final = None if dS_final is None else native.f32(dS_final)
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        dS0 = torch.empty(B, H, K, V, dtype=torch.float32) if ctx.has_S0 else None
        lib = native.library("kda")
        ptrs = [native.ptr(x) for x in (q, k, v, g, beta)]
        native.run_rows(lib.kda_bwd, native.split_rows(B * H, 1), lambda i, r0, r1: (
            *ptrs, ctx.scale, native.ptr(blocks), native.ptr(do), native.ptr(dS_final),
            B, T, H, K, V, r0, r1, *(native.ptr(x) for x in grads), native.ptr(dS0)))
        return (*grads, dS0, None)


def kda_native(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale: float, initial_state_BHKV=None):
    """Same contract as ``kda_reference``: (o [B, T, H, V] fp32, final state [B, H, K, V] fp32)."""
    return _KDA.apply(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, scale)
