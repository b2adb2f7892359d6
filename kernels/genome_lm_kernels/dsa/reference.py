"""Readable dense references for DSA with a k-pool indexer (small T only: they build [T, T]).

Notation: B batch, T tokens, H main heads, Hi indexer heads, D head dims, K = kpool,
N = T // K complete pools, S = selected slots per query (see ``slot_width``).

Indexer (GLM-5.3-Flash, transformers ``Glm5NextTextIndexer``):
    pool key      kp[n]   = sum_j softmax_j(gate[nK+j] + ape[j]) * k[nK+j]     (per channel)
    pool score    I[t, n] = sum_h w[t, h] * ReLU(scale * q[t, h] . kp[n])
    visible       pool n is visible to query t when its last token nK+K-1 <= t
    selection     the topk // K visible pools with the highest score (ties: lower pool first),
                  expanded to their K tokens, then the query's own incomplete pool (tail)
                  tokens t - (t+1) % K + 1 .. t, always.
"""

from __future__ import annotations

import torch


def slot_width(topk: int, kpool: int) -> int:
    """Index slots per query: topk // kpool pools of kpool tokens, padding up to topk, then the
    tail of at most kpool - 1 tokens (transformers' output width, ``index_topk + kpool - 1``)."""
    return topk + kpool - 1


def pool_keys(k_BTD, gate_BTD, ape_KD, kpool: int):
    """Softmax-gated mean over each complete pool: [B, T, D] -> [B, N, D] with N = T // kpool."""
    B, T, D = k_BTD.shape
    N = T // kpool
    k_BNKD = k_BTD[:, : N * kpool].reshape(B, N, kpool, D)
    logits = gate_BTD[:, : N * kpool].reshape(B, N, kpool, D).float() + ape_KD.float()
    probs = logits.softmax(dim=2).to(k_BTD.dtype)
    return (probs * k_BNKD).sum(dim=2)


def index_scores(q_BTHD, kp_BND, w_BTH, kpool: int, scale: float, t0: int = 0):
    """Dense pool scores I[b, t, n] of queries t0 .. t0+T-1 with -inf where the pool is not
    visible: [B, T, N]."""
    s_BTHN = torch.einsum("bthd,bnd->bthn", q_BTHD.double(), kp_BND.double())
    I_BTN = (torch.relu(s_BTHN * scale) * w_BTH.double()[..., None]).sum(2)
    T, N = q_BTHD.shape[1], kp_BND.shape[1]
    last_N = torch.arange(N) * kpool + kpool - 1
    visible_TN = last_N[None, :] <= torch.arange(t0, t0 + T)[:, None]
    return I_BTN.masked_fill(~visible_TN, float("-inf"))


def select_tokens(q_BTHD, k_BTD, w_BTH, gate_BTD, ape_KD, *, kpool: int, topk: int, scale: float):
    """Token indices [B, T, S] (int32, -1 = empty slot) and validity mask, from dense scores."""
    kp_BND = pool_keys(k_BTD, gate_BTD, ape_KD, kpool)
    idx_BTS = select_from_pools(q_BTHD, kp_BND, w_BTH, kpool=kpool, topk=topk, scale=scale,
                                n_pick=min(topk // kpool, kp_BND.shape[1]))
    return idx_BTS, idx_BTS >= 0


def select_from_pools(q_BTHD, kp_BND, w_BTH, *, kpool: int, topk: int, scale: float, n_pick: int, t0: int = 0):
    """Token indices [B, T, S] of queries t0 .. t0+T-1 from the pooled keys complete so far,
    ``n_pick`` pool slots (``select_tokens``' layout), one query at a time."""
    B, T = q_BTHD.shape[:2]
    I_BTN = index_scores(q_BTHD, kp_BND, w_BTH, kpool, scale, t0)
    idx_BTS = torch.full((B, T, slot_width(topk, kpool)), -1, dtype=torch.int32)
    for b in range(B):
        for r in range(T):
            t = t0 + r
            # Stable descending sort: among equal scores the lower pool comes first.
            order = torch.sort(I_BTN[b, r], descending=True, stable=True).indices[:n_pick]
            pools = sorted(p for p in order.tolist() if I_BTN[b, r, p] > float("-inf"))
            tokens = [p * kpool + j for p in pools for j in range(kpool)]
            idx_BTS[b, r, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            tail = list(range(t + 1 - (t + 1) % kpool, t + 1))
            idx_BTS[b, r, n_pick * kpool : n_pick * kpool + len(tail)] = torch.tensor(tail, dtype=torch.int32)
    return idx_BTS


def selected_mask(idx_BTS, T: int):
    """Boolean [B, T, T] mask of the selected keys of each query."""
    B = idx_BTS.shape[0]
    mask = torch.zeros(B, idx_BTS.shape[1], T + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(idx_BTS >= 0, idx_BTS, T).long(), True)
    return mask[..., :T]


def sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, *, scale: float):
    """Dense attention masked to the selected keys. Returns o [B, T, H, Dv] and lse [B, T, H];
    a query with nothing selected gets o = 0 and lse = -inf."""
    T = q_BTHD.shape[1]
    mask_B1TT = selected_mask(idx_BTS, T)[:, None]
    s_BHTT = torch.einsum("bthd,bshd->bhts", q_BTHD, k_BTHD) * scale
    # A row with no key would give NaN gradients through logsumexp: score it over all keys and
    # zero its probabilities instead.
    empty_B1T1 = ~mask_B1TT.any(-1, keepdim=True)
    s_BHTT = s_BHTT.masked_fill(~mask_B1TT & ~empty_B1T1, float("-inf"))
    lse_BHT = torch.logsumexp(s_BHTT, dim=-1)
    p_BHTT = torch.exp(s_BHTT - lse_BHT[..., None]) * mask_B1TT
    o_BTHD = torch.einsum("bhts,bshd->bthd", p_BHTT, v_BTHD)
    lse_BHT = lse_BHT.masked_fill(empty_B1T1[..., 0], float("-inf"))
    return o_BTHD, lse_BHT.transpose(1, 2)


def indexer_loss(q_idx_BTHD, k_idx_BTD, w_BTH, gate_BTD, ape_KD, q_BTHD, k_BTHD, idx_BTS=None,
                 *, kpool: int, idx_scale: float, scale: float):
    """KL(p || softmax(I)) over pools, averaged over queries that see at least one pool.

    p: the main attention (softmax over the candidate keys: every causally visible key in the
    dense mode, the selected keys when ``idx_BTS`` is given) summed over heads, summed over the
    tokens of each candidate pool (tail tokens dropped), L1-normalised. I: the indexer scores of
    the candidate pools. The main q, k are detached: only the indexer inputs get gradient."""
    B, T, H, _ = q_BTHD.shape
    kp_BND = pool_keys(k_idx_BTD, gate_BTD, ape_KD, kpool)
    N = kp_BND.shape[1]
    I_BTN = index_scores(q_idx_BTHD, kp_BND, w_BTH, kpool, idx_scale)
    causal_TT = torch.ones(T, T, dtype=torch.bool).tril()
    keys_BTT = causal_TT.expand(B, T, T) if idx_BTS is None else selected_mask(idx_BTS, T)
    s_BHTT = torch.einsum("bthd,bshd->bhts", q_BTHD.detach().double(), k_BTHD.detach().double()) * scale
    p_BTT = s_BHTT.masked_fill(~keys_BTT[:, None], float("-inf")).softmax(-1).nan_to_num().sum(1)
    p_BTN = p_BTT[..., : N * kpool].reshape(B, T, N, kpool).sum(-1)
    cand_BTN = keys_BTT[..., : N * kpool].reshape(B, T, N, kpool).all(-1) & (I_BTN > float("-inf"))
    p_BTN = p_BTN * cand_BTN
    p_BTN = p_BTN / p_BTN.sum(-1, keepdim=True).clamp_min(1e-300)
    logq_BTN = I_BTN.masked_fill(~cand_BTN, float("-inf")).log_softmax(-1)
    kl_BTN = torch.where(p_BTN > 0, p_BTN * (p_BTN.clamp_min(1e-300).log() - logq_BTN), 0.0)
    rows_BT = cand_BTN.any(-1)
    return kl_BTN.sum(-1)[rows_BT].mean()
