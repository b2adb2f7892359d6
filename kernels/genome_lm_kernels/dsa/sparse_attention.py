"""Sparse attention over selected keys, torch path: each query's own keys gathered, query chunks.

Each query attends only to the keys listed in its row of ``idx`` (-1 = empty slot; indices
are trusted to be causal; a key listed twice counts once, as in the dense-mask reference).

Per chunk of C queries the keys and values of every query's own S slots are gathered into
[C, S, H, D] blocks (one ``index_select`` of [T, H * D] rows; -1 slots read row 0 and are
masked), scored with broadcast products reduced over D, and softmax-ed over S. The work per
query is O(S * H * D) whatever T is, and nothing per chunk is O(T): the time is linear in T.
C is ``chunk``, lowered so that a gathered block holds at most ``GATHER_ELEMENTS`` values.

Why gather and not score a chunk against the union of its selections with matrix products:
when neighbouring queries select different pools (an untrained indexer) the union approaches
min(t, C * S) keys, so its work per query grows with T (measured: 7,412 union keys per chunk
at T = 32k for S = 259). On a CPU the gather is memory-bound; ``index_select`` on contiguous
rows and broadcast-multiply-reduce (not ``einsum``, which permutes the block into a batched
GEMM layout first) keep it at a few passes over the block.

Repeated keys: a row whose valid slots are strictly ascending (``select_tokens``' layout:
pools ascending, then the tail pool) cannot hold a repeat and is used as is; in a chunk with
any other row, each repeat after a key's first slot is masked (found by a per-row sort).

Short prefixes: a block whose queries can see only t1 <= ``DENSE_KEYS_PER_SLOT`` * S keys is
scored densely instead, [C, t1] per head with matrix products and a mask built from the slots
(a repeat sets the same mask bit, so it counts once). Matrix products run at many times the
rate of the gather, so for the first few thousand positions (all of a short sequence) this is
faster; its work per query is bounded by DENSE_KEYS_PER_SLOT * S, so the time stays linear in T.

Backward recomputes the chunk's probabilities from the saved log-sum-exp, writes dq directly
and accumulates dk, dv into [T, H * D] buffers with ``index_add_`` (gathered blocks) or slices
(dense blocks); no per-chunk graph is kept.
"""

from __future__ import annotations

import torch

from ..cpu import native
from .indexer import compute_dtype

GATHER_ELEMENTS = 1 << 21  # values of one gathered [C, S, H, D] block (8 MiB in fp32)
DENSE_KEYS_PER_SLOT = 8  # a block that sees at most this many keys per slot is scored densely


def queries_per_block(chunk: int, S: int, H: int, D: int) -> int:
    """Queries per chunk: ``chunk``, lowered so a gathered [C, S, H, D] block stays within
    ``GATHER_ELEMENTS`` values; depends on S, H, D only, never on T."""
    return max(1, min(chunk, GATHER_ELEMENTS // max(1, S * H * D)))


def own_keys(idx_CS):
    """Each query's slots, in their order, as (row index [C, S] with -1 -> 0, valid [C, S]
    bool): -1 slots and every repeat of a key after its first occurrence are invalid.
    O(C * S log S), never O(T)."""
    nonneg = idx_CS >= 0
    prev_max = idx_CS.cummax(dim=1).values[:, :-1]
    if bool((~nonneg[:, 1:] | (idx_CS[:, 1:] > prev_max)).all()):  # valid slots ascending: no repeat
        return idx_CS.clamp_min(0), nonneg
    srt, perm = idx_CS.sort(dim=1, stable=True)
    first = srt >= 0
    first[:, 1:] &= srt[:, 1:] != srt[:, :-1]  # a key listed twice counts once
    return idx_CS.clamp_min(0), torch.empty_like(first).scatter_(1, perm, first)


def gather_rows(x_TX, key_CS):
    """x [T, ...] rows at key [C, S] -> [C, S, ...] (one contiguous index_select)."""
    C, S = key_CS.shape
    return x_TX.flatten(1).index_select(0, key_CS.flatten()).view(C, S, *x_TX.shape[1:])


def gathered_probs(q_CHD, k_CSHD, valid_CS, scale, lse_CH=None):
    """Probabilities of each query over its own slots, p [C, S, H] (0 on invalid slots), and
    lse [C, H] (-inf for a query without any valid slot; recomputed unless given)."""
    s_CSH = (k_CSHD * q_CHD[:, None]).sum(-1).mul_(scale).masked_fill_(~valid_CS[..., None], float("-inf"))
    if lse_CH is None:
        lse_CH = torch.logsumexp(s_CSH, dim=1)
    return torch.exp_(s_CSH.sub_(lse_CH.nan_to_num(neginf=0.0)[:, None])), lse_CH


def _blocks(idx_BTS, chunk: int, H: int, D: int):
    return query_blocks(idx_BTS, chunk, H, D, DENSE_KEYS_PER_SLOT)


def query_blocks(idx_BTS, chunk: int, H: int, D: int, dense_keys_per_slot: int):
    """(b, t0, t1, key_CS, valid_CS) for each gathered block of queries of each sequence, and
    (b, t0, t1, mask_CK, None) for a dense block (keys 0..t1-1: at most ``dense_keys_per_slot``
    keys per slot)."""
    B, T, S = idx_BTS.shape
    C = queries_per_block(chunk, S, H, D)
    for b in range(B):
        for t0 in range(0, T, C):
            t1 = min(t0 + C, T)
            if t1 <= dense_keys_per_slot * S:
                yield b, t0, t1, dense_mask(idx_BTS[b, t0:t1], t1), None
            else:
                yield (b, t0, t1, *own_keys(idx_BTS[b, t0:t1]))


def dense_mask(idx_CS, n_keys: int):
    """[C, n_keys] bool: key j is selected by query c (-1 slots select nothing; repeats once)."""
    C = idx_CS.shape[0]
    mask = torch.zeros(C, n_keys + 1, dtype=torch.bool, device=idx_CS.device)  # last column: -1 slots
    mask.scatter_(1, torch.where(idx_CS >= 0, idx_CS, n_keys).long(), True)
    return mask[:, :n_keys]


def dense_probs(q_HCD, kT_HDK, mask_CK, scale, lse_HC=None):
    """Probabilities of each query over keys 0..K-1 under its mask, p [H, C, K], and lse [H, C]
    (-inf for a query without any selected key)."""
    s_HCK = torch.matmul(q_HCD, kT_HDK).mul_(scale).masked_fill_(~mask_CK, float("-inf"))
    if lse_HC is None:
        lse_HC = torch.logsumexp(s_HCK, dim=-1)
    return torch.exp_(s_HCK.sub_(lse_HC.nan_to_num(neginf=0.0)[..., None])), lse_HC


def _head_major(x_BTHD, b, dt):
    """Sequence b as [H, T, D] contiguous, for per-head matrix products over slices of T."""
    return x_BTHD[b].to(dt).transpose(0, 1).contiguous()


class SparseAttention(torch.autograd.Function):
    """o, lse = attention of q over k, v restricted to idx; see module docstring."""

    @staticmethod
    def forward(ctx, q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale: float, chunk: int, use_native: bool):
        ctx.mark_non_differentiable(idx_BTS)
        ctx.scale, ctx.chunk, ctx.native = scale, chunk, use_native
        if use_native:
            o_BTHD, lse_BTH = native_forward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale)
            ctx.save_for_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH)
            return o_BTHD, lse_BTH
        dt = compute_dtype(q_BTHD.dtype)
        B, T, H, D = q_BTHD.shape
        Dv = v_BTHD.shape[-1]
        kc_BTHD, vc_BTHD = k_BTHD.contiguous(), v_BTHD.contiguous()  # rows gathered as [H * D] vectors
        o_BTHD = torch.empty(B, T, H, Dv, dtype=dt, device=q_BTHD.device)
        lse_BTH = torch.empty(B, T, H, dtype=dt, device=q_BTHD.device)
        heads_major = {}  # per sequence, for dense blocks: q [H, T, D], k^T [H, D, T], v [H, T, Dv]
        for b, t0, t1, key_CS, valid_CS in _blocks(idx_BTS, chunk, H, max(D, Dv)):
            if valid_CS is None:  # dense block: key_CS is the [C, t1] mask
                if b not in heads_major:
                    heads_major = {b: (_head_major(q_BTHD, b, dt), _head_major(k_BTHD, b, dt).transpose(1, 2),
                                       _head_major(v_BTHD, b, dt))}
                q_HTD, kT_HDT, v_HTD = heads_major[b]
                p_HCK, lse_HC = dense_probs(q_HTD[:, t0:t1], kT_HDT[..., :t1], key_CS, scale)
                lse_BTH[b, t0:t1] = lse_HC.T
                o_BTHD[b, t0:t1] = torch.matmul(p_HCK, v_HTD[:, :t1]).transpose(0, 1)
                continue
            k_CSHD = gather_rows(kc_BTHD[b], key_CS).to(dt)
            p_CSH, lse_BTH[b, t0:t1] = gathered_probs(q_BTHD[b, t0:t1].to(dt), k_CSHD, valid_CS, scale)
            del k_CSHD
            o_BTHD[b, t0:t1] = (p_CSH[..., None] * gather_rows(vc_BTHD[b], key_CS).to(dt)).sum(1)
        o_BTHD = o_BTHD.to(q_BTHD.dtype)
        ctx.save_for_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH)
        return o_BTHD, lse_BTH

    @staticmethod
    def backward(ctx, do_BTHD, dlse_BTH):
        q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH = ctx.saved_tensors
        grads = native_backward if ctx.native else sparse_attention_backward
        dq, dk, dv = grads(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH, do_BTHD, dlse_BTH, ctx.scale, ctx.chunk)
        return dq, dk, dv, None, None, None, None


def native_forward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale: float):
    """The forward in C (``cpu/dsa.c``: one pass per query, threads over query rows), fp32."""
    lib = native.library("dsa")
    B, T, H, D = q_BTHD.shape
    Dv, S = v_BTHD.shape[-1], idx_BTS.shape[-1]
    q, k, v, idx = native.f32(q_BTHD), native.f32(k_BTHD), native.f32(v_BTHD), idx_BTS.to(torch.int32).contiguous()
    o = torch.empty(B, T, H, Dv, dtype=torch.float32)
    lse = torch.empty(B, T, H, dtype=torch.float32)
    p = native.ptr
    native.run_rows(lib.dsa_sparse_fwd, native.split_rows(B * T), lambda i, r0, r1: (
        p(q), p(k), p(v), p(idx), r0, r1, T, S, H, D, Dv, scale, p(o), p(lse)))
    return o.to(q_BTHD.dtype), lse


def native_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH, do_BTHD, dlse_BTH, scale: float, chunk: int):
    """``sparse_attention_backward`` in C; each thread adds dk, dv into its own buffer."""
    lib = native.library("dsa")
    B, T, H, D = q_BTHD.shape
    Dv, S = v_BTHD.shape[-1], idx_BTS.shape[-1]
    do = torch.zeros(o_BTHD.shape, dtype=torch.float32) if do_BTHD is None else native.f32(do_BTHD)
    delta = (do * o_BTHD.float()).sum(-1)
    if dlse_BTH is not None:
        delta -= dlse_BTH.float().nan_to_num(0.0)
    q, k, v, idx = native.f32(q_BTHD), native.f32(k_BTHD), native.f32(v_BTHD), idx_BTS.to(torch.int32).contiguous()
    lse, delta = native.f32(lse_BTH), delta.contiguous()
    ranges = native.split_rows(B * T)
    dq = torch.empty(B, T, H, D, dtype=torch.float32)
    dk = torch.zeros(len(ranges), B, T, H, D, dtype=torch.float32)
    dv = torch.zeros(len(ranges), B, T, H, Dv, dtype=torch.float32)
    p = native.ptr
    native.run_rows(lib.dsa_sparse_bwd, ranges, lambda i, r0, r1: (
        p(q), p(k), p(v), p(idx), p(lse), p(do), p(delta), r0, r1, T, S, H, D, Dv, scale, p(dq), p(dk[i]), p(dv[i])))
    return dq.to(q_BTHD.dtype), dk.sum(0).to(k_BTHD.dtype), dv.sum(0).to(v_BTHD.dtype)


def sparse_attention_backward(q_BTHD, k_BTHD, v_BTHD, idx_BTS, o_BTHD, lse_BTH, do_BTHD, dlse_BTH,
                              scale: float, chunk: int):
    """Gradients (dq, dk, dv) of the sparse attention, one block of queries at a time.

    With p = softmax(s) over the selected keys, D = rowsum(do * o) - dlse:
        ds = p * (do . v - D);  dq = scale ds k;  dk[key] += scale ds q;  dv[key] += p do."""
    dt = compute_dtype(q_BTHD.dtype)
    if do_BTHD is None:
        do_BTHD = torch.zeros_like(o_BTHD)
    delta_BTH = (do_BTHD.to(dt) * o_BTHD.to(dt)).sum(-1)
    if dlse_BTH is not None:
        delta_BTH = delta_BTH - dlse_BTH.to(dt).nan_to_num(0.0)
    B, T, H, D = q_BTHD.shape
    Dv = v_BTHD.shape[-1]
    lse_BTH = lse_BTH.to(dt)
    kc_BTHD, vc_BTHD = k_BTHD.contiguous(), v_BTHD.contiguous()
    dq_BTHD = torch.empty(q_BTHD.shape, dtype=dt, device=q_BTHD.device)
    dk_BTX = torch.zeros(B, T, H * D, dtype=dt, device=q_BTHD.device)
    dv_BTX = torch.zeros(B, T, H * Dv, dtype=dt, device=q_BTHD.device)
    heads_major = {}  # per sequence, for dense blocks: inputs [H, T, D] and dk, dv accumulators
    for b, t0, t1, key_CS, valid_CS in _blocks(idx_BTS, chunk, H, max(D, Dv)):
        if valid_CS is None:  # dense block over keys 0..t1-1, key_CS is the mask
            if b not in heads_major:
                _flush_dense(heads_major, dk_BTX, dv_BTX)
                heads_major = {b: [_head_major(x, b, dt) for x in (q_BTHD, k_BTHD, v_BTHD, do_BTHD)]
                               + [q_BTHD.new_zeros(H, T, D, dtype=dt), q_BTHD.new_zeros(H, T, Dv, dtype=dt)]}
            q_HTD, k_HTD, v_HTD, do_HTD, dk_HTD, dv_HTD = heads_major[b]
            q_HCD, do_HCD = q_HTD[:, t0:t1], do_HTD[:, t0:t1]
            p_HCK, _ = dense_probs(q_HCD, k_HTD[:, :t1].transpose(1, 2), key_CS, scale, lse_BTH[b, t0:t1].T)
            ds_HCK = torch.matmul(do_HCD, v_HTD[:, :t1].transpose(1, 2)).sub_(delta_BTH[b, t0:t1].T[..., None])
            ds_HCK.mul_(p_HCK)
            dq_BTHD[b, t0:t1] = torch.matmul(ds_HCK, k_HTD[:, :t1]).transpose(0, 1).mul_(scale)
            dk_HTD[:, :t1].baddbmm_(ds_HCK.transpose(1, 2), q_HCD, alpha=scale)
            dv_HTD[:, :t1].baddbmm_(p_HCK.transpose(1, 2), do_HCD)
            continue
        q_CHD, do_CHD = q_BTHD[b, t0:t1].to(dt), do_BTHD[b, t0:t1].to(dt)
        rows = key_CS.flatten()
        k_CSHD = gather_rows(kc_BTHD[b], key_CS).to(dt)
        p_CSH, _ = gathered_probs(q_CHD, k_CSHD, valid_CS, scale, lse_BTH[b, t0:t1])
        dp_CSH = (gather_rows(vc_BTHD[b], key_CS).to(dt) * do_CHD[:, None]).sum(-1)
        ds_CSH = dp_CSH.sub_(delta_BTH[b, t0:t1, None]).mul_(p_CSH)
        dq_BTHD[b, t0:t1] = (ds_CSH[..., None] * k_CSHD).sum(1).mul_(scale)
        del k_CSHD
        dk_BTX[b].index_add_(0, rows, (ds_CSH[..., None] * q_CHD[:, None]).flatten(0, 1).flatten(1), alpha=scale)
        dv_BTX[b].index_add_(0, rows, (p_CSH[..., None] * do_CHD[:, None]).flatten(0, 1).flatten(1))
    _flush_dense(heads_major, dk_BTX, dv_BTX)
    return (dq_BTHD.to(q_BTHD.dtype), dk_BTX.view(k_BTHD.shape).to(k_BTHD.dtype),
            dv_BTX.view(v_BTHD.shape).to(v_BTHD.dtype))


def _flush_dense(heads_major, dk_BTX, dv_BTX):
    """Add a sequence's dense-block dk, dv ([H, T, D]) into the [B, T, H * D] accumulators."""
    for b, (*_, dk_HTD, dv_HTD) in heads_major.items():
        dk_BTX[b] += dk_HTD.transpose(0, 1).flatten(1)
        dv_BTX[b] += dv_HTD.transpose(0, 1).flatten(1)


def sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, *, scale: float, chunk: int = 64,
                     use_native: bool = False):
    """q, k [B, T, H, Dqk], v [B, T, H, Dv], idx [B, T, S] int32 -> o [B, T, H, Dv], lse [B, T, H]
    (fp32, fp64 for fp64 inputs; -inf and o = 0 for a query with no selected key).

    ``use_native`` (the backend's ``native``): forward and backward in C (``cpu/dsa.c``) when the
    inputs are CPU tensors in fp32 / bf16 / fp16 (fp64 stays on the torch path)."""
    use_native = use_native and native.usable(q_BTHD, k_BTHD, v_BTHD)
    return SparseAttention.apply(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale, chunk, use_native)
