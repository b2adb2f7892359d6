"""Triton kernels: sparse attention forward and backward, and chunked indexer pool scores.

Attention (the non-absorbed form, per-head keys): one program per (query, head), looping over
the query's index slots in blocks of BLOCK_S with an online softmax; backward recomputes
probabilities from the saved lse and scatters dk, dv with fp32 atomics. Per query and head this
is a matrix-vector product no other head shares, so it runs on CUDA cores; the tensor-core form
of the same attention is ``triton_mla.py`` (absorbed MLA, keys shared by the heads).

Indexer: one program per (block of queries, block of pools); the (query, head) rows against the
pool keys are one matrix product (tensor cores for bf16 inputs).
Inputs fp32 / bf16 / fp16 (fp64 is refused: the kernels accumulate in fp32). They run on CPU
tensors under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from genome_lm_kernels.interpreter import share_language_patches
from genome_lm_kernels.kda.triton_fwd import mm

share_language_patches()  # under Triton's interpreter only


def _check(*xs):
    for x in xs:
        if x.dtype == torch.float64:
            raise ValueError("the triton DSA kernels accumulate in fp32; use the torch backend for fp64")


def _block(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


@triton.jit
def _attn_fwd(q, k, v, idx, o, lse, T, H, S, scale,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = bt // T
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_d = tl.load(q + (bt * H + h) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(idx + bt * S + offs_s, mask=offs_s < S, other=-1)
        ok = ids >= 0
        rows = b * T + tl.where(ok, ids, 0)
        k_sd = tl.load(k + (rows[:, None] * H + h) * D + offs_d[None, :],
                       mask=ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k_sd * q_d[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep zeros
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        v_sd = tl.load(v + (rows[:, None] * H + h) * DV + offs_dv[None, :],
                       mask=ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v_sd, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    empty = l_i == 0.0
    out = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_i))
    tl.store(o + (bt * H + h) * DV + offs_dv, out.to(o.dtype.element_ty), mask=offs_dv < DV)
    tl.store(lse + bt * H + h, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))))


@triton.jit
def _attn_bwd(q, k, v, idx, do, lse, delta, dq, dk, dv, T, H, S, scale,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = bt // T
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_d = tl.load(q + (bt * H + h) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    do_d = tl.load(do + (bt * H + h) * DV + offs_dv, mask=offs_dv < DV, other=0.0).to(tl.float32)
    lse_i = tl.load(lse + bt * H + h)
    lse_i = tl.where(lse_i == float("-inf"), 0.0, lse_i)
    delta_i = tl.load(delta + bt * H + h)
    dq_d = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(idx + bt * S + offs_s, mask=offs_s < S, other=-1)
        ok = ids >= 0
        rows = b * T + tl.where(ok, ids, 0)
        mk = ok[:, None] & (offs_d[None, :] < D)
        mv = ok[:, None] & (offs_dv[None, :] < DV)
        k_sd = tl.load(k + (rows[:, None] * H + h) * D + offs_d[None, :], mask=mk, other=0.0).to(tl.float32)
        v_sd = tl.load(v + (rows[:, None] * H + h) * DV + offs_dv[None, :], mask=mv, other=0.0).to(tl.float32)
        p = tl.where(ok, tl.exp(tl.sum(k_sd * q_d[None, :], 1) * scale - lse_i), 0.0)
        ds = p * (tl.sum(v_sd * do_d[None, :], 1) - delta_i)
        dq_d += tl.sum(ds[:, None] * k_sd, 0) * scale
        tl.atomic_add(dk + (rows[:, None] * H + h) * D + offs_d[None, :], ds[:, None] * q_d[None, :] * scale, mask=mk)
        tl.atomic_add(dv + (rows[:, None] * H + h) * DV + offs_dv[None, :], p[:, None] * do_d[None, :], mask=mv)
    tl.store(dq + (bt * H + h) * D + offs_d, dq_d, mask=offs_d < D)


class TritonSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale: float):
        _check(q_BTHD, k_BTHD, v_BTHD)
        q_BTHD, k_BTHD, v_BTHD, idx_BTS = (x.contiguous() for x in (q_BTHD, k_BTHD, v_BTHD, idx_BTS))
        B, T, H, D = q_BTHD.shape
        DV, S = v_BTHD.shape[-1], idx_BTS.shape[-1]
        o_BTHD = q_BTHD.new_empty(B, T, H, DV)
        lse_BTH = torch.empty(B, T, H, dtype=torch.float32, device=q_BTHD.device)
        _attn_fwd[(B * T, H)](q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH, T, H, S, scale,
                              D=D, DV=DV, BLOCK_S=_block(min(S, 64)), BLOCK_D=_block(D), BLOCK_DV=_block(DV))
        ctx.save_for_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH)
        ctx.scale = scale
        ctx.mark_non_differentiable(idx_BTS)
        return o_BTHD, lse_BTH

    @staticmethod
    def backward(ctx, do_BTHD, dlse_BTH):
        q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH = ctx.saved_tensors
        B, T, H, D = q_BTHD.shape
        DV, S = v_BTHD.shape[-1], idx_BTS.shape[-1]
        do_BTHD = torch.zeros_like(o_BTHD) if do_BTHD is None else do_BTHD.contiguous()
        delta_BTH = (do_BTHD.float() * o_BTHD.float()).sum(-1)
        if dlse_BTH is not None:
            delta_BTH = delta_BTH - dlse_BTH.float().nan_to_num(0.0)
        delta_BTH = delta_BTH.contiguous()
        dq = torch.empty(q_BTHD.shape, dtype=torch.float32, device=q_BTHD.device)
        dk = torch.zeros(k_BTHD.shape, dtype=torch.float32, device=q_BTHD.device)
        dv = torch.zeros(v_BTHD.shape, dtype=torch.float32, device=q_BTHD.device)
        _attn_bwd[(B * T, H)](q_BTHD, k_BTHD, v_BTHD, idx_BTS, do_BTHD, lse_BTH, delta_BTH, dq, dk, dv,
                              T, H, S, ctx.scale, D=D, DV=DV, BLOCK_S=_block(min(S, 64 if max(D, DV) <= 128 else 16)),
                              BLOCK_D=_block(D), BLOCK_DV=_block(DV))
        return dq.to(q_BTHD.dtype), dk.to(k_BTHD.dtype), dv.to(v_BTHD.dtype), None, None


def sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, *, scale: float):
    """Same contract as ``sparse_attention.sparse_attention``; lse is fp32."""
    return TritonSparseAttention.apply(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale)


@triton.jit
def _pool_scores(q, kp, w, out, t0, C, N, H, scale, KPOOL: tl.constexpr, D: tl.constexpr,
                 BQ: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, DOT: tl.constexpr):
    """Scores of BQ queries x BN pools: all BQ * HP (query, head) rows against the pool keys as one
    matrix product, then ReLU, the head weights and the sum over heads."""
    b = tl.program_id(0).to(tl.int64)
    qb, nb = tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, BQ * HP)
    c = qb * BQ + r // HP  # query within the chunk
    h = r % HP
    ok = (c < C) & (h < H)
    offs_d = tl.arange(0, BD)
    offs_n = nb * BN + tl.arange(0, BN)
    q_rd = tl.load(q + ((b * C + c) * H + h)[:, None] * D + offs_d[None, :],
                   mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)
    kp_nd = tl.load(kp + (b * N + offs_n[:, None]) * D + offs_d[None, :],
                    mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0)
    w_r = tl.load(w + (b * C + c) * H + h, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(mm(q_rd, tl.trans(kp_nd), DOT) * scale, 0.0) * w_r[:, None]  # [BQ * HP, BN]
    scores = tl.sum(tl.reshape(s, [BQ, HP, BN]), axis=1)  # [BQ, BN]
    cq = qb * BQ + tl.arange(0, BQ)
    visible = offs_n[None, :] * KPOOL + (KPOOL - 1) <= (t0 + cq)[:, None]
    tl.store(out + (b * C + cq)[:, None] * N + offs_n[None, :], tl.where(visible, scores, float("-inf")),
             mask=(cq < C)[:, None] & (offs_n[None, :] < N))


def pool_scores_chunk(q_BCHD, kp_BND, w_BCH, t0: int, scale: float, kpool: int):
    """Triton version of ``indexer.pool_scores_chunk``: [B, C, N] fp32, -inf where invisible.
    The products run in the inputs' precision: bf16 operands for bf16 (tensor cores), fp32
    ("ieee") for fp32 inputs, so a selection does not change with the backend."""
    _check(q_BCHD, kp_BND, w_BCH)
    q_BCHD, kp_BND, w_BCH = q_BCHD.contiguous(), kp_BND.contiguous(), w_BCH.contiguous()
    B, C, H, D = q_BCHD.shape
    N = kp_BND.shape[1]
    out = torch.empty(B, C, N, dtype=torch.float32, device=q_BCHD.device)
    if N == 0:
        return out
    HP = triton.next_power_of_2(H)
    BQ = max(1, 64 // HP)  # 64 (query, head) rows per product (HP rows when the heads are more)
    BN = min(_block(N, 16), 64)
    if q_BCHD.dtype == torch.float32:
        dot = "ieee"
    else:
        dot = "bf16-emulated" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"
    _pool_scores[(B, triton.cdiv(C, BQ), triton.cdiv(N, BN))](
        q_BCHD, kp_BND, w_BCH, out, t0, C, N, H, scale, KPOOL=kpool, D=D, BQ=BQ, HP=HP, BN=BN,
        BD=_block(D), DOT=dot, num_warps=4)
    return out
