"""Indexer KL loss (DeepSeek-V3.2), torch path, chunked over queries.

    loss = mean over queries t with >= 1 candidate pool of  KL(p_t || softmax(I_t))

Candidates: the complete pools visible to t (dense warm-up mode) or the pools selected for t
(sparse mode, ``idx`` from ``select_tokens``). p_t: the main attention of t over its candidate
keys (every visible key / every selected key, tail included) per head, summed over heads,
summed over each candidate pool's tokens (the tail is dropped: it has no indexer score),
L1-normalised. I_t: indexer pool scores.

Heads split over ranks (tensor / context parallel): p_t sums over every head, and a rank holds
only some. ``reduce_target(p, block)`` sums a [B, C, M] block of this rank's per-head sum over
the ranks before it is normalised, once per query block in forward (and again in backward when
it recomputes the target), so that each rank needs only its own heads' q and k. Every rank must
then call the loss with the same B, T, chunk and candidates. The queries may be shared out too:
``reduce_target`` returns the summed block only to the rank that computes that block's KL term
(None on the others), and each rank's loss is then the sum of its own blocks' terms over the
whole sequence's query count, so that the ranks' losses (and gradients) add up to the loss.

Gradient: only the indexer tensors get one (q_idx, w_idx and the pooled keys, hence k_idx, gate
and ape); the main q and k are detached here, and the caller detaches the hidden states that
feed the indexer projections, as DeepSeek-V3.2 does, so the loss trains the indexer only.
Memory per chunk: dense mode [B, H, chunk, T] attention probabilities and [B, chunk, Hi, N]
indexer scores; sparse mode gathers each query's own selected keys (as ``sparse_attention``
does), O(S) work per query. Backward recomputes the indexer scores per chunk; the target p
(without gradient, most of the work) it takes from forward when all the blocks' targets fit in
``KEEP_TARGET_BYTES`` (about [T, N / 2] values: up to T = 8k for kpool 4 at batch 1) and
recomputes it otherwise, so nothing of size [T, T] is ever held, nor [T, N] past that bound.

Dense-mode target on a CPU: the keys are laid out [B, H, D, T] once per call so that each block
is one matrix product, only the block's diagonal [C, C] part is masked (earlier keys are visible
to all its queries), and pools are summed as kpool strided slices; with the kept targets, the
loss's forward + backward at T = 8k (tiny model's sizes) went from 0.70 s to 0.46 s.
"""

from __future__ import annotations

import torch

from ..cpu import native
from .indexer import compute_dtype, pool_keys, visible_pools
from .sparse_attention import gather_rows, gathered_probs, own_keys, queries_per_block

# Forward keeps every query block's target p for backward when they take at most this much
# (dense mode at T = 8k, kpool 4, batch 1: 32 MiB), instead of computing them again there: the
# target is most of the loss's time (a [B, H, C, t] softmax per block).
KEEP_TARGET_BYTES = 64 << 20


def _n_candidates(t1, kpool, N, S):
    """M, the candidate pools of a query block ending before t1: the complete pools (dense mode,
    S None) or the selected ones (S = topk + kpool - 1 slots)."""
    return min(N, t1 // kpool) if S is None else min((S - kpool + 1) // kpool, N)


def _candidates(idx_BTS, t0, t1, kpool, N, B, device):
    """Candidate pool ids [B, C, M] of queries t0..t1-1 (-1 = none): the complete pools each sees
    (dense mode, ``idx_BTS`` None) or its selected pools (the first M * kpool slots)."""
    if idx_BTS is None:
        M = _n_candidates(t1, kpool, N, None)
        vis_CM = visible_pools(t0, t1 - t0, M, kpool, device)
        return torch.where(vis_CM, torch.arange(M, device=device), -1).expand(B, t1 - t0, M)
    M = _n_candidates(t1, kpool, N, idx_BTS.shape[-1])
    first_BCM = idx_BTS[:, t0:t1, : M * kpool : kpool]
    return torch.where(first_BCM >= 0, first_BCM // kpool, -1)


def _target(q_BTHD, k_BTHD, idx_BTS, pools_BCM, t0, t1, kpool, scale, dt, reduce_target=None, w_uk=None,
            block=0):
    """p [B, C, M] (L1-normalised) over the candidate pools ``pools_BCM``; ``reduce_target`` sums
    the per-head sum over the ranks that hold the other heads (None: another rank takes query
    block ``block``); ``w_uk`` [H, E, D]: q holds per-head queries, absorbed here one query block
    at a time."""
    B, C, M = pools_BCM.shape
    q_BCHD = q_BTHD[:, t0:t1]
    if w_uk is not None:
        q_BCHD = torch.einsum("bche,hed->bchd", q_BCHD, w_uk)
    q_BCHD = q_BCHD.to(dt)
    if idx_BTS is None:  # dense: every key up to t1 - 1, causal mask inside the chunk
        # k_BTHD is here the keys transposed once per call, [B, H, D, T] in dt (``_keys_by_dim``):
        # a plain matrix product per chunk, no permute of [t1] keys each time
        s_BHCT = (q_BCHD.transpose(1, 2) @ k_BTHD[..., :t1]).mul_(scale)
        # keys before the chunk are visible to all its queries: only the diagonal block is masked
        future_CC = torch.ones(C, C, dtype=torch.bool, device=q_BTHD.device).triu(1)
        s_BHCT[..., t0:t1].masked_fill_(future_CC, float("-inf"))
        p_BCT = s_BHCT.softmax(-1).sum(1)
        # a pool's probability: its kpool tokens added as strided slices (a sum over a trailing
        # dimension of kpool elements runs about 4x slower on CPU)
        p_BCM = p_BCT[..., 0 : M * kpool : kpool].clone()
        for j in range(1, kpool):
            p_BCM += p_BCT[..., j : M * kpool : kpool]
    else:  # sparse: the selected keys; pool slots come first in kpool-token groups
        idx_BCS = idx_BTS[:, t0:t1]
        p_BCS = torch.stack([_selected_probs(q_BCHD[b], k_BTHD[b], idx_BCS[b], scale, dt) for b in range(B)])
        p_BCM = p_BCS[..., : M * kpool].unflatten(-1, (M, kpool)).sum(-1)
    p_BCM = p_BCM * (pools_BCM >= 0)
    if reduce_target is not None:
        p_BCM = reduce_target(p_BCM.contiguous(), block)
        if p_BCM is None:
            return None
    return p_BCM / p_BCM.sum(-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)


def _target_bytes(B, T, N, S, kpool, chunk, itemsize):
    """Bytes of every query block's target p [B, C, M] together (M = the block's candidates)."""
    values = 0
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        values += (t1 - t0) * _n_candidates(t1, kpool, N, S)
    return B * itemsize * values


def _keys_by_dim(k_BTHD, dt):
    """[B, T, H, D] -> [B, H, D, T] contiguous in dt: the dense target's keys, laid out once."""
    return k_BTHD.to(dt).permute(0, 2, 3, 1).contiguous()


def _selected_probs(q_CHD, k_THD, idx_CS, scale, dt):
    """Main attention over each query's selected keys, summed over heads, per slot: [C, S]
    (0 on -1 and repeated slots). Gathers each query's own keys, like ``sparse_attention``,
    in blocks of ``queries_per_block`` queries: O(S) work per query whatever T is."""
    C, S = idx_CS.shape
    H, D = q_CHD.shape[1], k_THD.shape[-1]  # k may hold one head shared by all (absorbed MLA)
    p_CS = torch.empty(C, S, dtype=dt, device=idx_CS.device)
    step = queries_per_block(C, S, H, D)
    for a in range(0, C, step):
        key_cS, valid_cS = own_keys(idx_CS[a : a + step])
        p_cSH, _ = gathered_probs(q_CHD[a : a + step], gather_rows(k_THD, key_cS).to(dt), valid_cS, scale)
        p_CS[a : a + step] = p_cSH.sum(-1)
    return p_CS


def _scores(q_BCHD, kp, w_BCH, pools_BCM, scale):
    """Indexer scores [B, C, M] of the candidate pools (kp [B, M, D] shared or [B, C, M, D])."""
    r = "bchd,bmd->bchm" if kp.dim() == 3 else "bchd,bcmd->bchm"
    I_BCM = (torch.relu(torch.einsum(r, q_BCHD, kp) * scale) * w_BCH[..., None]).sum(2)
    return I_BCM.masked_fill(pools_BCM < 0, float("-inf"))


class IndexerLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx_BTHD, kp_BND, w_BTH, q_BTHD, k_BTHD, idx_BTS, kpool, idx_scale, scale, chunk,
                reduce_target, w_uk):
        dt = compute_dtype(q_idx_BTHD.dtype)
        B, T = q_idx_BTHD.shape[:2]
        N = kp_BND.shape[1]
        total = torch.zeros((), dtype=dt, device=q_idx_BTHD.device)
        rows = 0
        keys = _keys_by_dim(k_BTHD, dt) if idx_BTS is None else k_BTHD
        S = None if idx_BTS is None else idx_BTS.shape[-1]
        # Keep the targets for backward when they are small; every rank decides the same way
        # (same B, T, N), so the calls to reduce_target still match across ranks.
        kept = [] if _target_bytes(B, T, N, S, kpool, chunk, dt.itemsize) <= KEEP_TARGET_BYTES else None
        for block, t0 in enumerate(range(0, T, chunk)):
            t1 = min(t0 + chunk, T)
            pools_BCM = _candidates(idx_BTS, t0, t1, kpool, N, B, q_idx_BTHD.device)
            rows += int((pools_BCM >= 0).any(-1).sum())
            p_BCM = _target(q_BTHD, keys, idx_BTS, pools_BCM, t0, t1, kpool, scale, dt, reduce_target, w_uk, block)
            if kept is not None:
                kept.append(p_BCM)
            if p_BCM is None:  # another rank's block
                continue
            kp = _candidate_keys(kp_BND, pools_BCM, idx_BTS is None).to(dt)
            I_BCM = _scores(q_idx_BTHD[:, t0:t1].to(dt), kp, w_BTH[:, t0:t1].to(dt), pools_BCM, idx_scale)
            logq_BCM = I_BCM.log_softmax(-1)
            kl = torch.where(p_BCM > 0, p_BCM * (p_BCM.clamp_min(torch.finfo(dt).tiny).log() - logq_BCM), 0.0)
            total += kl.sum()
        ctx.save_for_backward(q_idx_BTHD, kp_BND, w_BTH, q_BTHD, k_BTHD, idx_BTS, w_uk)
        ctx.args = (kpool, idx_scale, scale, chunk, max(rows, 1), reduce_target)
        ctx.kept = kept
        return total / max(rows, 1)

    @staticmethod
    def backward(ctx, g):
        q_idx_BTHD, kp_BND, w_BTH, q_BTHD, k_BTHD, idx_BTS, w_uk = ctx.saved_tensors
        kpool, idx_scale, scale, chunk, rows, reduce_target = ctx.args
        kept, ctx.kept = ctx.kept, None
        dt = compute_dtype(q_idx_BTHD.dtype)
        B, T, N = q_idx_BTHD.shape[0], q_idx_BTHD.shape[1], kp_BND.shape[1]
        dq = torch.zeros(q_idx_BTHD.shape, dtype=dt, device=q_idx_BTHD.device)
        dw = torch.zeros(w_BTH.shape, dtype=dt, device=w_BTH.device)
        dkp = torch.zeros(kp_BND.shape, dtype=dt, device=kp_BND.device)
        keys = _keys_by_dim(k_BTHD, dt) if idx_BTS is None and kept is None else k_BTHD
        for block, t0 in enumerate(range(0, T, chunk)):
            t1 = min(t0 + chunk, T)
            pools_BCM = _candidates(idx_BTS, t0, t1, kpool, N, B, q_idx_BTHD.device)
            if kept is not None:
                p_BCM = kept[block]
            else:
                with torch.no_grad():
                    p_BCM = _target(q_BTHD, keys, idx_BTS, pools_BCM, t0, t1, kpool, scale, dt, reduce_target, w_uk,
                                    block)
            if p_BCM is None:  # another rank's block
                continue
            with torch.enable_grad():
                q_c = q_idx_BTHD[:, t0:t1].detach().to(dt).requires_grad_()
                w_c = w_BTH[:, t0:t1].detach().to(dt).requires_grad_()
                kp_c = _candidate_keys(kp_BND.detach(), pools_BCM, idx_BTS is None).to(dt).requires_grad_()
                I_BCM = _scores(q_c, kp_c, w_c, pools_BCM, idx_scale)
                # d KL / d I = softmax(I) - p on candidates (rows sum p to 1 or have no candidate).
                dI = (I_BCM.detach().softmax(-1).nan_to_num(0.0) - p_BCM) * (pools_BCM >= 0) * (g / rows)
                gq, gw, gkp = torch.autograd.grad(I_BCM, (q_c, w_c, kp_c), dI.to(dt))
            dq[:, t0:t1] = gq
            dw[:, t0:t1] = gw
            if idx_BTS is None:
                dkp[:, : gkp.shape[1]] += gkp
            else:
                offs = torch.arange(kp_BND.shape[0], device=dkp.device)[:, None, None] * N
                dkp.view(-1, dkp.shape[-1]).index_add_(0, (pools_BCM.clamp_min(0) + offs).flatten(), gkp.flatten(0, 2))
        return (dq.to(q_idx_BTHD.dtype), dkp.to(kp_BND.dtype), dw.to(w_BTH.dtype),
                None, None, None, None, None, None, None, None, None)


def _candidate_keys(kp_BND, pools_BCM, dense: bool):
    if dense:
        return kp_BND[:, : pools_BCM.shape[-1]]
    B, N, D = kp_BND.shape
    rows = pools_BCM.clamp_min(0) + torch.arange(B, device=kp_BND.device)[:, None, None] * N
    return kp_BND.reshape(B * N, D).index_select(0, rows.flatten()).view(*pools_BCM.shape, D)


def indexer_loss(q_idx_BTHD, k_idx_BTD, w_BTH, q_BTHD, k_BTHD, idx_BTS=None, *, gate_BTD=None, ape_KD=None,
                 kpool: int, idx_scale: float | None = None, scale: float, chunk: int = 64, reduce_target=None,
                 w_uk_HED=None, use_native: bool = False):
    """Scalar KL loss; ``idx_BTS=None`` is the dense warm-up mode, else the sparse mode.
    Shapes as in ``select_tokens`` (indexer) and ``sparse_attention`` (main q, k: this rank's
    heads, summed over the ranks by ``reduce_target`` when given; k [B, T, 1, D] is one key
    head shared by every query head, as absorbed MLA's latent; then ``w_uk_HED`` [H, E, D] lets q
    be the per-head queries [B, T, H, E], absorbed one query block at a time).
    ``use_native`` (the backend's ``native``): the dense mode in C (``NativeDenseIndexerLoss``)
    where it applies (dense mode, no reduce_target or w_uk, CPU tensors not in fp64)."""
    idx_scale = q_idx_BTHD.shape[-1] ** -0.5 if idx_scale is None else idx_scale
    use_native = (use_native and idx_BTS is None and reduce_target is None and w_uk_HED is None
                  and native.usable(q_idx_BTHD, k_idx_BTD, w_BTH, q_BTHD, k_BTHD))
    # Pool keys in fp32 (not the input dtype, as selection does): a bf16 rounding of the keys
    # flips ReLUs and makes the gradient noisy; the gradient still flows back to bf16 leaves.
    kp_BND = pool_keys(k_idx_BTD.to(compute_dtype(k_idx_BTD.dtype)), gate_BTD, ape_KD, kpool=kpool)
    if use_native:
        return NativeDenseIndexerLoss.apply(q_idx_BTHD, kp_BND, w_BTH, q_BTHD.detach(), k_BTHD.detach(), kpool,
                                            idx_scale, scale)
    return IndexerLoss.apply(q_idx_BTHD, kp_BND, w_BTH, q_BTHD.detach(), k_BTHD.detach().contiguous(), idx_BTS,
                             kpool, idx_scale, scale, chunk, reduce_target,
                             None if w_uk_HED is None else w_uk_HED.detach())


class NativeDenseIndexerLoss(torch.autograd.Function):
    """The dense-mode loss in C (``cpu/dsa.c``): one pass per query computes its target, its KL
    term and the term's gradient with respect to q_idx, w and the pooled keys, so backward only
    scales what forward wrote (nothing recomputed, no target kept). fp32 throughout."""

    @staticmethod
    def forward(ctx, q_idx_BTHD, kp_BND, w_BTH, q_BTHD, k_BTHD, kpool, idx_scale, scale):
        lib = native.library("dsa")
        B, T, Hi, Di = q_idx_BTHD.shape
        N, (H, D) = kp_BND.shape[1], q_BTHD.shape[2:]
        f32 = torch.float32
        q, qi, w, kp = (native.f32(x) for x in (q_BTHD, q_idx_BTHD, w_BTH, kp_BND))
        kT = k_BTHD.to(f32).permute(0, 2, 3, 1).contiguous()  # [B, H, D, T]
        kpT = kp.transpose(1, 2).contiguous()  # [B, Di, N]
        ranges = native.split_rows(B * T)
        kl = torch.empty(B * T, dtype=f32)
        dqi, dw = torch.empty(B, T, Hi, Di, dtype=f32), torch.empty(B, T, Hi, dtype=f32)
        dkp = torch.zeros(len(ranges), B, N, Di, dtype=f32)
        p = native.ptr
        native.run_rows(lib.dsa_indexer_loss_dense, ranges, lambda i, r0, r1: (
            p(q), p(kT), p(qi), p(kp), p(kpT), p(w), r0, r1, T, N, H, D, Hi, Di, kpool, scale, idx_scale,
            p(kl), p(dqi), p(dw), p(dkp[i])))
        rows = max(B * max(0, T - kpool + 1) if N > 0 else 0, 1)  # queries with at least one complete pool
        ctx.grads = (dqi / rows, dkp.sum(0) / rows, dw / rows)
        ctx.dtypes = (q_idx_BTHD.dtype, kp_BND.dtype, w_BTH.dtype)
        return kl.sum() / rows

    @staticmethod
    def backward(ctx, g):
        grads, ctx.grads = ctx.grads, None
        dq, dkp, dw = ((x * g).to(dt) for x, dt in zip(grads, ctx.dtypes))
        return dq, dkp, dw, None, None, None, None, None
