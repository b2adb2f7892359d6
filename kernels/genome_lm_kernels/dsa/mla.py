"""Sparse attention over a shared latent (MLA in its absorbed form), reference and torch path.

MLA keeps one latent vector per token, c [T, Dc] (``kv_a_layernorm(kv_a_proj(x))``). Per head h
the keys and values are k_h = W_UK[h] c and v_h = W_UV[h] c, so with the absorbed query
qa_h = W_UK[h]^T q_h:

    q_h . k_h[s] = qa_h . c[s]          o_h = W_UV[h] sum_s p_h[s] c[s]

Attention then runs over the latent itself, one "key/value head" shared by every query head
(DeepSeek's FlashMLA sparse kernels and megatron-core's absorbed DSA take this form). This file
computes that core: keys are kv [B, T, D] (all D channels), values its first ``dv`` channels,
for each query over the slots of its row of ``idx`` (-1 = empty). Every head of a query reads
the same gathered rows, so on a GPU the scores are a [heads, D] x [D, slots] matrix product
(``triton_mla.py``); per query and head the non-absorbed form is a matrix-vector product over
[slots, D] rows that no head shares.

Slots must not repeat a key within a row for the Triton kernel (``select_tokens``' layout
guarantees it: ascending pools, then the tail); the reference and the torch path count a
repeated key once.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch

from .indexer import compute_dtype
from .sparse_attention import dense_mask, gather_rows, query_blocks

DENSE_KEYS_PER_SLOT = 8  # a block of queries that sees at most this many keys per slot is scored densely


def sparse_mla_reference(q_BTHD, kv_BTD, idx_BTS, *, scale: float, dv: int):
    """Dense [T, T] reference (small T): o [B, T, H, dv], lse [B, T, H] in fp64."""
    B, T, H, D = q_BTHD.shape
    q, kv = q_BTHD.double(), kv_BTD.double()
    s_BHTT = torch.einsum("bthd,bsd->bhts", q, kv) * scale
    mask_BTT = torch.stack([dense_mask(idx_BTS[b], T) for b in range(B)])
    s_BHTT = s_BHTT.masked_fill(~mask_BTT[:, None], float("-inf"))
    lse_BHT = torch.logsumexp(s_BHTT, dim=-1)
    p = torch.exp(s_BHTT - lse_BHT.nan_to_num(neginf=0.0)[..., None])
    o_BTHD = torch.einsum("bhts,bsd->bthd", p, kv[..., :dv])
    return o_BTHD, lse_BHT.transpose(1, 2)


def _blocks(idx_BTS, chunk: int, H: int, D: int):
    """``sparse_attention``'s blocks, sized for one gathered [S, D] row set shared by the heads."""
    return query_blocks(idx_BTS, chunk, 1, max(D, H), DENSE_KEYS_PER_SLOT)


def _probs(s_CHK, valid_CK, scale, lse_CH=None):
    """p [C, H, K] from raw scores (0 where not valid) and lse [C, H] (-inf: no key)."""
    s_CHK = s_CHK.mul_(scale).masked_fill_(~valid_CK[:, None], float("-inf"))
    if lse_CH is None:
        lse_CH = torch.logsumexp(s_CHK, dim=-1)
    return torch.exp_(s_CHK.sub_(lse_CH.nan_to_num(neginf=0.0)[..., None])), lse_CH


class _Block:
    """One block of queries and the keys they see: the first t1 rows, shared (dense, plain
    matrix products), or each query's own gathered slots ([C, S, D] batched products)."""

    def __init__(self, kv_TD, t1, key_CS, valid_CS, dt):
        self.dense = valid_CS is None
        self.key_CS = key_CS
        if self.dense:  # key_CS is the [C, t1] mask
            self.keys, self.valid = kv_TD[:t1].to(dt), key_CS
        else:
            self.keys, self.valid = gather_rows(kv_TD, key_CS).to(dt), valid_CS

    def scores(self, x_CHX, dv: int | None = None):
        """x . keys (over the first dv channels if given): [C, H, K]."""
        keys = self.keys if dv is None else self.keys[..., :dv]
        if self.dense:
            C, H, X = x_CHX.shape
            return (x_CHX.reshape(C * H, X) @ keys.T).view(C, H, -1)
        return torch.bmm(x_CHX, keys.transpose(1, 2))

    def mix(self, p_CHK, dv: int | None = None):
        """p @ keys (their first dv channels if given): [C, H, D or dv]."""
        keys = self.keys if dv is None else self.keys[..., :dv]
        if self.dense:
            C, H, K = p_CHK.shape
            return (p_CHK.reshape(C * H, K) @ keys).view(C, H, -1)
        return torch.bmm(p_CHK, keys)

    def transposed(self, p_CHK, x_CHX):
        """p^T x, summed over the heads: [K, X] (dense, shared keys) or [C, K, X]."""
        if self.dense:
            C, H, K = p_CHK.shape
            return p_CHK.reshape(C * H, K).T @ x_CHX.reshape(C * H, -1)
        return torch.bmm(p_CHK.transpose(1, 2), x_CHX)


def sparse_mla_forward(q_BTHD, kv_BTD, idx_BTS, scale: float, dv: int, chunk: int):
    """(o [B, T, H, dv] in q's dtype, lse [B, T, H] fp32/fp64), block by block, no autograd."""
    dt = compute_dtype(q_BTHD.dtype)
    B, T, H, D = q_BTHD.shape
    o_BTHD = torch.empty(B, T, H, dv, dtype=dt, device=q_BTHD.device)
    lse_BTH = torch.empty(B, T, H, dtype=dt, device=q_BTHD.device)
    kv_BTD = kv_BTD.contiguous()
    for b, t0, t1, key_CS, valid_CS in _blocks(idx_BTS, chunk, H, D):
        blk = _Block(kv_BTD[b], t1, key_CS, valid_CS, dt)
        p_CHK, lse_BTH[b, t0:t1] = _probs(blk.scores(q_BTHD[b, t0:t1].to(dt)), blk.valid, scale)
        o_BTHD[b, t0:t1] = blk.mix(p_CHK, dv)
    return o_BTHD.to(q_BTHD.dtype), lse_BTH


class SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BTHD, kv_BTD, idx_BTS, scale: float, dv: int, chunk: int):
        with torch.no_grad():
            o_BTHD, lse_BTH = sparse_mla_forward(q_BTHD, kv_BTD, idx_BTS, scale, dv, chunk)
        ctx.save_for_backward(q_BTHD, kv_BTD, idx_BTS, o_BTHD, lse_BTH)
        ctx.scale, ctx.dv, ctx.chunk = scale, dv, chunk
        ctx.mark_non_differentiable(idx_BTS)
        return o_BTHD, lse_BTH

    @staticmethod
    def backward(ctx, do_BTHD, dlse_BTH):
        q_BTHD, kv_BTD, idx_BTS, o_BTHD, lse_BTH = ctx.saved_tensors
        dq, dkv = sparse_mla_backward(q_BTHD, kv_BTD, idx_BTS, o_BTHD, lse_BTH, do_BTHD, dlse_BTH,
                                      ctx.scale, ctx.dv, ctx.chunk)
        return dq, dkv, None, None, None, None


class AbsorbedSparseMLA(torch.autograd.Function):
    """The same attention for per-head queries q [B, T, H, Dq] and W_UK [H, Dq, D]: the absorbed
    query q W_UK is formed inside, and formed again in backward rather than saved ([T, H, D] is
    the largest tensor of the layer: 512 channels a head against q's 256). ``impl`` holds the
    backend's forward and backward (``sparse_mla_forward`` / ``sparse_mla_backward`` or
    ``triton_mla``'s)."""

    @staticmethod
    def forward(ctx, q_BTHE, w_uk_HED, kv_BTD, idx_BTS, scale: float, dv: int, impl):
        q_abs = torch.einsum("bthe,hed->bthd", q_BTHE, w_uk_HED)
        o_BTHD, lse_BTH = impl.forward(q_abs, kv_BTD, idx_BTS, scale, dv)
        ctx.save_for_backward(q_BTHE, w_uk_HED, kv_BTD, idx_BTS, o_BTHD, lse_BTH)
        ctx.scale, ctx.dv, ctx.impl = scale, dv, impl
        ctx.mark_non_differentiable(idx_BTS)
        return o_BTHD, lse_BTH

    @staticmethod
    def backward(ctx, do_BTHD, dlse_BTH):
        q_BTHE, w_uk_HED, kv_BTD, idx_BTS, o_BTHD, lse_BTH = ctx.saved_tensors
        q_abs = torch.einsum("bthe,hed->bthd", q_BTHE, w_uk_HED)
        dq_abs, dkv = ctx.impl.backward(q_abs, kv_BTD, idx_BTS, o_BTHD, lse_BTH, do_BTHD, dlse_BTH, ctx.scale, ctx.dv)
        del q_abs
        dq_abs = dq_abs.to(q_BTHE.dtype)
        dq = torch.einsum("bthd,hed->bthe", dq_abs, w_uk_HED)
        dw_uk = torch.einsum("bthe,bthd->hed", q_BTHE, dq_abs)
        return dq, dw_uk, dkv, None, None, None, None


class Impl(NamedTuple):
    """A backend's forward (q, kv, idx, scale, dv) -> (o, lse) and backward
    (q, kv, idx, o, lse, do, dlse, scale, dv) -> (dq, dkv), for ``AbsorbedSparseMLA``."""

    forward: Callable
    backward: Callable


def sparse_mla_backward(q_BTHD, kv_BTD, idx_BTS, o_BTHD, lse_BTH, do_BTHD, dlse_BTH, scale: float, dv: int,
                        chunk: int):
    """(dq, dkv). With p = softmax(s), delta = rowsum(do * o) - dlse, ds = p (do . v - delta):
    dq = scale ds K;  dkv[key] += scale ds^T q  (+ p^T do on its first dv channels)."""
    dt = compute_dtype(q_BTHD.dtype)
    if do_BTHD is None:
        do_BTHD = torch.zeros_like(o_BTHD)
    delta_BTH = (do_BTHD.to(dt) * o_BTHD.to(dt)).sum(-1)
    if dlse_BTH is not None:
        delta_BTH = delta_BTH - dlse_BTH.to(dt).nan_to_num(0.0)
    B, T, H, D = q_BTHD.shape
    dq_BTHD = torch.empty(q_BTHD.shape, dtype=dt, device=q_BTHD.device)
    dkv_BTD = torch.zeros(B, T, D, dtype=dt, device=q_BTHD.device)
    kv_BTD = kv_BTD.contiguous()
    for b, t0, t1, key_CS, valid_CS in _blocks(idx_BTS, chunk, H, D):
        blk = _Block(kv_BTD[b], t1, key_CS, valid_CS, dt)
        q_CHD, do_CHD = q_BTHD[b, t0:t1].to(dt), do_BTHD[b, t0:t1].to(dt)
        p_CHK, _ = _probs(blk.scores(q_CHD), blk.valid, scale, lse_BTH[b, t0:t1].to(dt))
        ds_CHK = blk.scores(do_CHD, dv).sub_(delta_BTH[b, t0:t1, :, None]).mul_(p_CHK)
        dq_BTHD[b, t0:t1] = blk.mix(ds_CHK).mul_(scale)
        dkeys = blk.transposed(ds_CHK, q_CHD).mul_(scale)
        dkeys[..., :dv] += blk.transposed(p_CHK, do_CHD)
        if blk.dense:
            dkv_BTD[b, :t1] += dkeys
        else:
            dkv_BTD[b].index_add_(0, key_CS.flatten(), dkeys.flatten(0, 1))
    return dq_BTHD.to(q_BTHD.dtype), dkv_BTD.to(kv_BTD.dtype)


def sparse_mla(q_BTHD, kv_BTD, idx_BTS, *, scale: float, dv: int, chunk: int = 64, w_uk_HED=None):
    """q [B, T, H, D], kv [B, T, D], idx [B, T, S] -> o [B, T, H, dv], lse [B, T, H] (fp32; fp64
    for fp64 inputs; -inf and o = 0 for a query with no selected key). With ``w_uk_HED``
    [H, E, D], q is the per-head query [B, T, H, E], absorbed inside (``AbsorbedSparseMLA``)."""
    if w_uk_HED is not None:
        impl = Impl(partial(sparse_mla_forward, chunk=chunk), partial(sparse_mla_backward, chunk=chunk))
        return AbsorbedSparseMLA.apply(q_BTHD, w_uk_HED, kv_BTD, idx_BTS, scale, dv, impl)
    return SparseMLA.apply(q_BTHD, kv_BTD, idx_BTS, scale, dv, chunk)
