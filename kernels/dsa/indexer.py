"""k-pool lightning indexer, torch path: pooled keys, chunked pool scores and token selection.

Memory: one query chunk at a time, [B, chunk, N] scores with N = T // kpool; no [T, T] tensor.

Output layout of ``select_tokens`` (per query, S = topk + kpool - 1 slots):
    [ selected pools, ascending, kpool tokens each | -1 for unused pool slots ]   P * kpool
    [ the query's incomplete tail pool t - (t+1) % kpool + 1 .. t | -1        ]   kpool - 1
    [ -1 padding                                                              ]   topk - P * kpool
with P = min(topk // kpool, T // kpool), exactly the slots of transformers' indexer.
transformers' ``Glm5NextTextIndexer`` uses the same slots but orders pools by score; as sets
they agree. Ties: among pools with equal scores the lower (earlier) pool is selected, so the
result does not depend on ``torch.topk``'s unspecified tie order.
"""

from __future__ import annotations

from typing import Callable

import torch

from .reference import slot_width

ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float, int], torch.Tensor]


def pool_keys(k_BTD, gate_BTD=None, ape_KD=None, *, kpool: int):
    """Pooled indexer keys of the complete pools: kp [B, N, D], N = T // kpool (differentiable).

    Each channel of a pool key is a softmax-gated mean of its kpool tokens, gate logits
    ``gate[token] + ape[position in pool]`` (``None`` means zeros, i.e. a plain mean)."""
    B, T, D = k_BTD.shape
    N = T // kpool
    k_BNKD = k_BTD[:, : N * kpool].reshape(B, N, kpool, D)
    logits = torch.zeros((), dtype=torch.float32, device=k_BTD.device)
    if gate_BTD is not None:
        logits = logits + gate_BTD[:, : N * kpool].reshape(B, N, kpool, D).float()
    if ape_KD is not None:
        logits = logits + ape_KD.float()
    probs = logits.expand(B, N, kpool, D).softmax(dim=2).to(k_BTD.dtype)
    return (probs * k_BNKD).sum(dim=2)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores are computed in fp32 (fp64 stays fp64), as transformers does."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pool_scores_chunk(q_BCHD, kp_BND, w_BCH, t0: int, scale: float, kpool: int):
    """Pool scores of queries t0 .. t0+C-1: [B, C, N], -inf where the pool is not yet complete.

    Loops over indexer heads so the working set stays [B, C, N]."""
    dt = compute_dtype(q_BCHD.dtype)
    B, C, H, _ = q_BCHD.shape
    N = kp_BND.shape[1]
    kpT_BDN = kp_BND.to(dt).transpose(1, 2)
    I_BCN = torch.zeros(B, C, N, dtype=dt, device=q_BCHD.device)
    for h in range(H):
        s_BCN = torch.bmm(q_BCHD[:, :, h].to(dt), kpT_BDN)
        I_BCN.addcmul_(torch.relu_(s_BCN.mul_(scale)), w_BCH[:, :, h, None].to(dt))
    return I_BCN.masked_fill_(~visible_pools(t0, C, N, kpool, q_BCHD.device), float("-inf"))


def visible_pools(t0: int, C: int, N: int, kpool: int, device) -> torch.Tensor:
    """[C, N] bool: pool n is complete at query t (its last token n*kpool + kpool - 1 <= t)."""
    t_C = torch.arange(t0, t0 + C, device=device)
    last_N = torch.arange(N, device=device) * kpool + (kpool - 1)
    return last_N[None, :] <= t_C[:, None]


def pick_pools(I_BCN: torch.Tensor, n_pick: int) -> torch.Tensor:
    """Top ``n_pick`` finite scores per row, ties to the lower pool: [B, C, n_pick] pool ids
    ascending, -1 where fewer than n_pick pools are visible."""
    B, C, N = I_BCN.shape
    out = torch.full((B, C, n_pick + 1), -1, dtype=torch.long, device=I_BCN.device)
    if n_pick == 0 or N == 0:
        return out[..., :n_pick]
    k = min(n_pick, N)
    thr_BC1 = I_BCN.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    finite = I_BCN > float("-inf")
    above = (I_BCN > thr_BC1) & finite
    tied = (I_BCN == thr_BC1) & finite
    need_BC1 = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(-1) <= need_BC1))
    slot = chosen.cumsum(-1) - 1  # position of each chosen pool among the chosen, ascending
    slot = torch.where(chosen, slot, n_pick)  # unchosen pools write to a dropped column
    pools = torch.arange(N, device=I_BCN.device).expand(B, C, N)
    out.scatter_(-1, slot, pools)
    return out[..., :n_pick]


def expand_to_tokens(pools_BCP, t0: int, *, kpool: int, topk: int):
    """Pool ids [B, C, P] -> token slots [B, C, S] in the layout of the module docstring."""
    B, C, P = pools_BCP.shape
    dev = pools_BCP.device
    tok_BCPK = pools_BCP[..., None] * kpool + torch.arange(kpool, device=dev)
    tok_BCPK = tok_BCPK.masked_fill(pools_BCP[..., None] < 0, -1)
    pad = torch.full((B, C, topk - P * kpool), -1, dtype=torch.long, device=dev)
    t_C = torch.arange(t0, t0 + C, device=dev)
    start_C = t_C + 1 - (t_C + 1) % kpool
    tail_CJ = start_C[:, None] + torch.arange(kpool - 1, device=dev)
    tail_CJ = tail_CJ.masked_fill(tail_CJ > t_C[:, None], -1)
    return torch.cat([tok_BCPK.flatten(2), tail_CJ.expand(B, C, kpool - 1), pad], dim=-1)


def torch_scores(q_BCHD, kp_BND, w_BCH, t0, scale, kpool):
    return pool_scores_chunk(q_BCHD, kp_BND, w_BCH, t0, scale, kpool)


@torch.no_grad()
def select_tokens(q_BTHD, k_BTD, w_BTH, gate_BTD=None, ape_KD=None, *, kpool: int, topk: int,
                  scale: float | None = None, chunk: int = 64, score_fn: ScoreFn = torch_scores):
    """Selected token indices [B, T, S] (int64, -1 = empty) and validity mask [B, T, S].

    q [B, T, Hi, D] indexer queries; k [B, T, D] indexer keys (shared by the heads);
    w [B, T, Hi] head weights (transformers: ``weights_proj(x) * Hi**-0.5``);
    gate [B, T, D] pool gate logits (``x @ index_kpool_compress_gate.T``); ape [kpool, D];
    scale defaults to D**-0.5. S = topk + kpool - 1."""
    B, T, _, D = q_BTHD.shape
    scale = D**-0.5 if scale is None else scale
    kp_BND = pool_keys(k_BTD, gate_BTD, ape_KD, kpool=kpool)
    n_pick = min(topk // kpool, kp_BND.shape[1])
    S = slot_width(topk, kpool)
    idx_BTS = torch.empty(B, T, S, dtype=torch.long, device=q_BTHD.device)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        # Pools ending after t1 - 1 are invisible to the whole chunk: skip them.
        N_c = min(kp_BND.shape[1], t1 // kpool)
        I_BCN = score_fn(q_BTHD[:, t0:t1], kp_BND[:, :N_c], w_BTH[:, t0:t1], t0, scale, kpool)
        pools = pick_pools(I_BCN, min(n_pick, N_c))
        if pools.shape[-1] < n_pick:
            pools = torch.nn.functional.pad(pools, (0, n_pick - pools.shape[-1]), value=-1)
        idx_BTS[:, t0:t1] = expand_to_tokens(pools, t0, kpool=kpool, topk=topk)
    return idx_BTS, idx_BTS >= 0
