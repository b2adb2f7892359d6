"""Sparse attention over a shared latent (``mla.py``) in Triton, on tensor cores.

One program per (query, block of heads). All heads of a query read the same selected latent
rows, so per block of BS slots the program gathers [BS, D] rows once and computes
    scores [heads, BS] = q [heads, D] @ rows^T        acc [heads, dv] += p @ rows[:, :dv]
as matrix products (bf16 operands, fp32 accumulation; fp32 "ieee" products in the exact mode),
with an online softmax over the slots. The backward recomputes p from the saved lse and adds
each block's [BS, D] latent gradient, scale ds^T q (+ p^T do on the first dv channels), into
dkv with fp32 atomics: a selected row receives one addition per query that selected it and per
head block. Slots must not repeat a key within a row.

Heads are padded to a multiple of 16 (the smallest matrix-product tile); D and dv are padded
to powers of two (at most 512 each: the model's latent is 512).
"""

from __future__ import annotations

import os
from functools import partial

import torch
import triton
import triton.language as tl

from genome_lm_kernels.interpreter import share_language_patches

share_language_patches()  # under Triton's interpreter only

from genome_lm_kernels.kda.triton_fwd import mm  # noqa: E402  (after the interpreter patch)

MAX_DIM = 512


@triton.jit
def _mla_fwd(q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, T, H, S, scale,
             D: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
             BDV: tl.constexpr, DOT: tl.constexpr):
    bt, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b = bt // T
    heads = hb * BH + tl.arange(0, BH)
    mh = heads < H
    cd, cv = tl.arange(0, BD), tl.arange(0, BDV)
    q = tl.load(q_ptr + (bt * H + heads)[:, None] * D + cd[None, :], mask=mh[:, None] & (cd < D)[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BDV], dtype=tl.float32)
    for s0 in range(0, S, BS):
        slots = s0 + tl.arange(0, BS)
        ids = tl.load(idx_ptr + bt * S + slots, mask=slots < S, other=-1)
        ok = ids >= 0
        rows = b * T + tl.where(ok, ids, 0)
        keys = tl.load(kv_ptr + rows[:, None] * D + cd[None, :], mask=ok[:, None] & (cd < D)[None, :], other=0.0)
        s = tl.where(ok[None, :], mm(q, tl.trans(keys), DOT) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep zeros
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        values = tl.load(kv_ptr + rows[:, None] * D + cv[None, :], mask=ok[:, None] & (cv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + mm(p, values, DOT)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    tl.store(o_ptr + (bt * H + heads)[:, None] * DV + cv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mh[:, None] & (cv < DV)[None, :])
    tl.store(lse_ptr + bt * H + heads, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))),
             mask=mh)


@triton.jit
def _mla_bwd(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, T, H, S, scale,
             D: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
             BDV: tl.constexpr, DOT: tl.constexpr):
    bt, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b = bt // T
    heads = hb * BH + tl.arange(0, BH)
    mh = heads < H
    cd, cv = tl.arange(0, BD), tl.arange(0, BDV)
    q = tl.load(q_ptr + (bt * H + heads)[:, None] * D + cd[None, :], mask=mh[:, None] & (cd < D)[None, :], other=0.0)
    do = tl.load(do_ptr + (bt * H + heads)[:, None] * DV + cv[None, :], mask=mh[:, None] & (cv < DV)[None, :],
                 other=0.0)
    lse = tl.load(lse_ptr + bt * H + heads, mask=mh, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + bt * H + heads, mask=mh, other=0.0)
    dq = tl.zeros([BH, BD], dtype=tl.float32)
    for s0 in range(0, S, BS):
        slots = s0 + tl.arange(0, BS)
        ids = tl.load(idx_ptr + bt * S + slots, mask=slots < S, other=-1)
        ok = ids >= 0
        rows = b * T + tl.where(ok, ids, 0)
        mk = ok[:, None] & (cd < D)[None, :]
        mv = ok[:, None] & (cv < DV)[None, :]
        keys = tl.load(kv_ptr + rows[:, None] * D + cd[None, :], mask=mk, other=0.0)
        values = tl.load(kv_ptr + rows[:, None] * D + cv[None, :], mask=mv, other=0.0)
        p = tl.where(ok[None, :] & mh[:, None], tl.exp(mm(q, tl.trans(keys), DOT) * scale - lse[:, None]), 0.0)
        ds = p * (mm(do, tl.trans(values), DOT) - delta[:, None])
        dq += mm(ds, keys, DOT)
        tl.atomic_add(dkv_ptr + rows[:, None] * D + cd[None, :], mm(tl.trans(ds), q, DOT) * scale, mask=mk)
        tl.atomic_add(dkv_ptr + rows[:, None] * D + cv[None, :], mm(tl.trans(p), do, DOT), mask=mv)
    tl.store(dq_ptr + (bt * H + heads)[:, None] * D + cd[None, :], dq * scale, mask=mh[:, None] & (cd < D)[None, :])


def _dot_mode(exact: bool) -> str:
    """fp32 products when exact; else bf16 operands (emulated exactly under the interpreter)."""
    if exact:
        return "ieee"
    return "bf16-emulated" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"


def _tiles(H: int, D: int, dv: int, exact: bool, backward: bool):
    """(BH, BS, BD, BDV, warps): heads per program (a multiple of 16), slots per block."""
    if max(D, dv) > MAX_DIM:
        raise ValueError(f"the triton sparse MLA kernels take D, dv <= {MAX_DIM}; got {D}, {dv}")
    BD, BDV = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(dv))
    wide = max(BD, BDV) >= 256
    BH = min(32 if wide else 64, max(16, triton.next_power_of_2(H)))
    BS = 16 if (backward and wide) or exact else 32
    return BH, BS, BD, BDV, 8 if wide else 4


def triton_forward(q_BTHD, kv_BTD, idx_BTS, scale: float, dv: int, exact: bool = False):
    """(o [B, T, H, dv] in q's dtype, lse [B, T, H] fp32), no autograd."""
    if q_BTHD.dtype == torch.float64:
        raise ValueError("the triton sparse MLA kernels accumulate in fp32; use the torch backend for fp64")
    q_BTHD, kv_BTD, idx_BTS = (x.contiguous() for x in (q_BTHD, kv_BTD, idx_BTS))
    B, T, H, D = q_BTHD.shape
    S = idx_BTS.shape[-1]
    o = q_BTHD.new_empty(B, T, H, dv)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q_BTHD.device)
    BH, BS, BD, BDV, warps = _tiles(H, D, dv, exact, backward=False)
    _mla_fwd[(B * T, triton.cdiv(H, BH))](q_BTHD, kv_BTD, idx_BTS, o, lse, T, H, S, scale, D=D, DV=dv, BH=BH,
                                          BS=BS, BD=BD, BDV=BDV, DOT=_dot_mode(exact), num_warps=warps)
    return o, lse


def triton_backward(q_BTHD, kv_BTD, idx_BTS, o, lse, do_BTHD, dlse_BTH, scale: float, dv: int, exact: bool = False):
    """(dq fp32 as q's shape, dkv in kv's dtype)."""
    q_BTHD, kv_BTD, idx_BTS = (x.contiguous() for x in (q_BTHD, kv_BTD, idx_BTS))
    B, T, H, D = q_BTHD.shape
    S = idx_BTS.shape[-1]
    do_BTHD = torch.zeros_like(o) if do_BTHD is None else do_BTHD.contiguous()
    delta = (do_BTHD.float() * o.float()).sum(-1)
    if dlse_BTH is not None:
        delta = delta - dlse_BTH.float().nan_to_num(0.0)
    dq = torch.empty(q_BTHD.shape, dtype=torch.float32, device=q_BTHD.device)
    dkv = torch.zeros(kv_BTD.shape, dtype=torch.float32, device=q_BTHD.device)
    BH, BS, BD, BDV, warps = _tiles(H, D, dv, exact, backward=True)
    _mla_bwd[(B * T, triton.cdiv(H, BH))](q_BTHD, kv_BTD, idx_BTS, do_BTHD, lse, delta.contiguous(), dq, dkv,
                                          T, H, S, scale, D=D, DV=dv, BH=BH, BS=BS, BD=BD, BDV=BDV,
                                          DOT=_dot_mode(exact), num_warps=warps)
    return dq, dkv.to(kv_BTD.dtype)


class TritonSparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BTHD, kv_BTD, idx_BTS, scale: float, dv: int, exact: bool):
        o, lse = triton_forward(q_BTHD, kv_BTD, idx_BTS, scale, dv, exact)
        ctx.save_for_backward(q_BTHD, kv_BTD, idx_BTS, o, lse)
        ctx.scale, ctx.dv, ctx.exact = scale, dv, exact
        ctx.mark_non_differentiable(idx_BTS)
        return o, lse

    @staticmethod
    def backward(ctx, do_BTHD, dlse_BTH):
        q_BTHD, kv_BTD, idx_BTS, o, lse = ctx.saved_tensors
        dq, dkv = triton_backward(q_BTHD, kv_BTD, idx_BTS, o, lse, do_BTHD, dlse_BTH, ctx.scale, ctx.dv, ctx.exact)
        return dq.to(q_BTHD.dtype), dkv, None, None, None, None


def sparse_mla(q_BTHD, kv_BTD, idx_BTS, *, scale: float, dv: int, exact: bool = False, w_uk_HED=None):
    """Same contract as ``mla.sparse_mla``; lse is fp32."""
    if w_uk_HED is not None:
        from .mla import AbsorbedSparseMLA, Impl

        impl = Impl(partial(triton_forward, exact=exact), partial(triton_backward, exact=exact))
        return AbsorbedSparseMLA.apply(q_BTHD, w_uk_HED, kv_BTD, idx_BTS, scale, dv, impl)
    return TritonSparseMLA.apply(q_BTHD, kv_BTD, idx_BTS, scale, dv, exact)
