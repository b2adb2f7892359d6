"""Sparse attention over selected keys, torch path: gathered keys/values, query chunks.

Each query attends only to the keys listed in its row of ``idx`` (-1 = empty slot; indices
are trusted to be causal; a key listed twice counts once, as in the dense-mask reference).

CPU strategy: per query chunk, gather the union U of the keys the chunk's queries selected
(once, not once per query), score the chunk against it with matrix products and mask each
query to its own selection. On a CPU a per-query gather moves S * D values per query and head
and is memory-bound (about 4 GB/s here); the union costs C * U * D multiply-adds in GEMMs, which
run an order of magnitude faster per value, and U is small when neighbouring queries select
the same pools. But when neighbouring queries select different pools (an untrained indexer),
U approaches min(t, C * S) and the union's work grows with T. So a chunk whose union exceeds
``GATHER_ABOVE`` times S keys instead gathers each query's own S keys ([C, S, H, D], split into
sub-chunks of at most ``GATHER_ELEMENTS`` values): O(S) work per query whatever T is. Either
way a chunk's working set is bounded by C^2 * S, never [T, T]. Backward recomputes the chunk's
probabilities from the saved log-sum-exp and scatters dk, dv into the keys' rows; no per-chunk
graph is kept alive.
"""

from __future__ import annotations

import torch

from .indexer import compute_dtype


GATHER_ABOVE = 2  # a union of more than GATHER_ABOVE * S keys: gather per query instead
GATHER_ELEMENTS = 1 << 22  # values of one gathered [C, S, H, D] block


def _own_keys(idx_CS):
    """Each query's keys with repeats and -1 masked out: (safe index [C, S], valid [C, S])."""
    srt, _ = idx_CS.sort(dim=1)
    valid = srt >= 0
    valid[:, 1:] &= srt[:, 1:] != srt[:, :-1]  # a key listed twice counts once
    return srt.clamp_min(0), valid


def _gather_probs(q_CHD, k_CSHD, valid_CS, scale, lse_HC=None):
    """Like _probs, over each query's own keys: p [H, C, S], lse [H, C]."""
    s_HCS = torch.einsum("chd,cshd->hcs", q_CHD, k_CSHD).mul_(scale).masked_fill_(~valid_CS, float("-inf"))
    if lse_HC is None:
        lse_HC = torch.logsumexp(s_HCS, dim=-1)
    return torch.exp_(s_HCS.sub_(lse_HC.nan_to_num(neginf=0.0)[..., None])), lse_HC


def _sub_chunks(t0: int, t1: int, S: int, H: int, D: int):
    step = max(1, GATHER_ELEMENTS // max(1, S * H * D))
    for a in range(t0, t1, step):
        yield a, min(a + step, t1)


def _union(idx_CS, T: int):
    """Keys selected by any query of the chunk, ascending: keys_U [U], and each query's
    selection as a mask over them: sel_CU [C, U] bool."""
    mark = torch.zeros(T + 1, dtype=torch.bool, device=idx_CS.device)
    slot_CS = torch.where(idx_CS >= 0, idx_CS, T)
    mark[slot_CS] = True
    mark[T] = False
    keys_U = mark.nonzero().squeeze(1)
    pos = torch.cumsum(mark, 0) - 1  # position of a key in keys_U
    U = keys_U.shape[0]
    sel_CU = torch.zeros(idx_CS.shape[0], U + 1, dtype=torch.bool, device=idx_CS.device)
    sel_CU.scatter_(1, torch.where(idx_CS >= 0, pos[slot_CS], U), True)
    return keys_U, sel_CU[:, :U]


def _probs(q_HCD, k_HUD, sel_CU, scale, lse_HC=None):
    """p [H, C, U] over the selected keys (0 elsewhere) and lse [H, C] (-inf: no key)."""
    s_HCU = torch.matmul(q_HCD, k_HUD.transpose(1, 2)).mul_(scale).masked_fill_(~sel_CU, float("-inf"))
    if lse_HC is None:
        lse_HC = torch.logsumexp(s_HCU, dim=-1)
    return torch.exp_(s_HCU.sub_(lse_HC.nan_to_num(neginf=0.0)[..., None])), lse_HC


def _chunks(idx_BTS, chunk: int):
    """(b, t0, t1, keys_U, sel_CU) for each query chunk of each sequence."""
    B, T, _ = idx_BTS.shape
    for b in range(B):
        for t0 in range(0, T, chunk):
            t1 = min(t0 + chunk, T)
            yield (b, t0, t1, *_union(idx_BTS[b, t0:t1], T))


class SparseAttention(torch.autograd.Function):
    """o, lse = attention of q over k, v restricted to idx; see module docstring."""

    @staticmethod
    def forward(ctx, q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale: float, chunk: int):
        dt = compute_dtype(q_BTHD.dtype)
        q_BHTD, k_BHTD, v_BHTD = (x.transpose(1, 2).to(dt) for x in (q_BTHD, k_BTHD, v_BTHD))
        B, H, T, _ = q_BHTD.shape
        o_BHTD = torch.empty(B, H, T, v_BTHD.shape[-1], dtype=dt, device=q_BTHD.device)
        lse_BHT = torch.empty(B, H, T, dtype=dt, device=q_BTHD.device)
        S, D = idx_BTS.shape[-1], q_BTHD.shape[-1]
        for b, t0, t1, keys_U, sel_CU in _chunks(idx_BTS, chunk):
            if keys_U.shape[0] > GATHER_ABOVE * S:
                for a, z in _sub_chunks(t0, t1, S, H, D):
                    key_CS, valid_CS = _own_keys(idx_BTS[b, a:z])
                    q_CHD = q_BTHD[b, a:z].to(dt)
                    p_HCS, lse_BHT[b, :, a:z] = _gather_probs(q_CHD, k_BTHD[b][key_CS].to(dt), valid_CS, scale)
                    o_BHTD[b, :, a:z] = torch.einsum("hcs,cshd->hcd", p_HCS, v_BTHD[b][key_CS].to(dt))
                continue
            p_HCU, lse_BHT[b, :, t0:t1] = _probs(q_BHTD[b, :, t0:t1], k_BHTD[b][:, keys_U], sel_CU, scale)
            o_BHTD[b, :, t0:t1] = torch.matmul(p_HCU, v_BHTD[b][:, keys_U])
        o_BTHD = o_BHTD.transpose(1, 2).to(q_BTHD.dtype).contiguous()
        lse_BTH = lse_BHT.transpose(1, 2).contiguous()
        ctx.save_for_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.mark_non_differentiable(idx_BTS)
        return o_BTHD, lse_BTH

    @staticmethod
    def backward(ctx, do_BTHD, dlse_BTH):
        q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH = ctx.saved_tensors
        dq, dk, dv = sparse_attention_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH,
                                               do_BTHD, dlse_BTH, ctx.scale, ctx.chunk)
        return dq, dk, dv, None, None, None


def sparse_attention_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH, do_BTHD, dlse_BTH,
                              scale: float, chunk: int):
    """Gradients (dq, dk, dv) of the sparse attention, one query chunk at a time.

    With p = softmax(s) over the selected keys, D = rowsum(do * o) - dlse:
        ds = p * (do . v - D);  dq = scale ds k;  dk[key] += scale ds q;  dv[key] += p do."""
    dt = compute_dtype(q_BTHD.dtype)
    if do_BTHD is None:
        do_BTHD = torch.zeros_like(o_BTHD)
    delta_BTH = (do_BTHD.to(dt) * o_BTHD.to(dt)).sum(-1)
    if dlse_BTH is not None:
        delta_BTH = delta_BTH - dlse_BTH.to(dt).nan_to_num(0.0)
    q_BHTD, k_BHTD, v_BHTD, do_BHTD = (x.transpose(1, 2).to(dt) for x in (q_BTHD, k_BTHD, v_BTHD, do_BTHD))
    delta_BHT, lse_BHT = delta_BTH.transpose(1, 2), lse_BTH.transpose(1, 2).to(dt)
    dq_BHTD = torch.empty(q_BHTD.shape, dtype=dt, device=q_BTHD.device)
    dk_BTHD = torch.zeros(k_BTHD.shape, dtype=dt, device=q_BTHD.device)
    dv_BTHD = torch.zeros(v_BTHD.shape, dtype=dt, device=q_BTHD.device)
    S, H, D = idx_BTS.shape[-1], q_BTHD.shape[2], q_BTHD.shape[-1]
    for b, t0, t1, keys_U, sel_CU in _chunks(idx_BTS, chunk):
        if keys_U.shape[0] > GATHER_ABOVE * S:
            for a, z in _sub_chunks(t0, t1, S, H, D):
                key_CS, valid_CS = _own_keys(idx_BTS[b, a:z])
                q_CHD, do_CHD = q_BTHD[b, a:z].to(dt), do_BTHD[b, a:z].to(dt)
                k_CSHD, v_CSHD = k_BTHD[b][key_CS].to(dt), v_BTHD[b][key_CS].to(dt)
                p_HCS, _ = _gather_probs(q_CHD, k_CSHD, valid_CS, scale, lse_BHT[b, :, a:z])
                ds_HCS = p_HCS * (torch.einsum("chd,cshd->hcs", do_CHD, v_CSHD) - delta_BHT[b, :, a:z, None])
                dq_BHTD[b, :, a:z] = torch.einsum("hcs,cshd->hcd", ds_HCS, k_CSHD).mul_(scale)
                rows = key_CS.flatten()
                dk_BTHD[b].index_add_(0, rows, torch.einsum("hcs,chd->cshd", ds_HCS, q_CHD).flatten(0, 1), alpha=scale)
                dv_BTHD[b].index_add_(0, rows, torch.einsum("hcs,chd->cshd", p_HCS, do_CHD).flatten(0, 1))
            continue
        q_HCD, do_HCD = q_BHTD[b, :, t0:t1], do_BHTD[b, :, t0:t1]
        k_HUD, v_HUD = k_BHTD[b][:, keys_U], v_BHTD[b][:, keys_U]
        p_HCU, _ = _probs(q_HCD, k_HUD, sel_CU, scale, lse_BHT[b, :, t0:t1])
        ds_HCU = p_HCU * (torch.matmul(do_HCD, v_HUD.transpose(1, 2)) - delta_BHT[b, :, t0:t1, None])
        dq_BHTD[b, :, t0:t1] = torch.matmul(ds_HCU, k_HUD).mul_(scale)
        dk_BTHD[b].index_add_(0, keys_U, torch.matmul(ds_HCU.transpose(1, 2), q_HCD).transpose(0, 1), alpha=scale)
        dv_BTHD[b].index_add_(0, keys_U, torch.matmul(p_HCU.transpose(1, 2), do_HCD).transpose(0, 1))
    return (dq_BHTD.transpose(1, 2).to(q_BTHD.dtype).contiguous(), dk_BTHD.to(k_BTHD.dtype),
            dv_BTHD.to(v_BTHD.dtype))


def sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, *, scale: float, chunk: int = 64):
    """q, k [B, T, H, Dqk], v [B, T, H, Dv], idx [B, T, S] int64 -> o [B, T, H, Dv], lse [B, T, H]
    (fp32, fp64 for fp64 inputs; -inf and o = 0 for a query with no selected key)."""
    return SparseAttention.apply(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale, chunk)
