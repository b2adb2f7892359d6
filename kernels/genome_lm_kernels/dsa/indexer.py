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

from ..cpu import native
from .reference import slot_width

ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float, int], torch.Tensor]

# Token indices of a selection: int32 (a sequence is far shorter than 2^31 tokens), half the
# memory of int64 for the [B, T, S] index every DSA layer holds; the kernels widen to int64 where
# they form row offsets (batch x T x heads x width). Pool ids (``selection_pools``) are int32 too.
SELECTION_DTYPE = torch.int32


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
    q_BCHD = q_BCHD.to(dt) * scale
    I_BCN = torch.zeros(B, C, N, dtype=dt, device=q_BCHD.device)
    for h in range(H):
        s_BCN = torch.bmm(q_BCHD[:, :, h], kpT_BDN)
        I_BCN.addcmul_(torch.relu_(s_BCN), w_BCH[:, :, h, None].to(dt))
    # pools before n0 end at or before t0: visible to every query of the chunk
    n0 = min((t0 + 1) // kpool, N)
    tail = I_BCN[..., n0:]
    tail.masked_fill_(~visible_pools(t0, C, N, kpool, q_BCHD.device, first=n0), float("-inf"))
    return I_BCN


def visible_pools(t0: int, C: int, N: int, kpool: int, device, first: int = 0) -> torch.Tensor:
    """[C, N - first] bool: pool n (from ``first``) is complete at query t (its last token
    n*kpool + kpool - 1 <= t)."""
    t_C = torch.arange(t0, t0 + C, device=device)
    last_N = torch.arange(first, N, device=device) * kpool + (kpool - 1)
    return last_N[None, :] <= t_C[:, None]


BLOCK = 16  # pools per block of the top-k pre-filter
TIED_ROWS = 16  # tied rows re-picked at a time


def pick_pools(I_BCN: torch.Tensor, n_pick: int) -> torch.Tensor:
    """Top ``n_pick`` finite scores per row, ties to the lower pool: [B, C, n_pick] pool ids
    ascending, -1 where fewer than n_pick pools are visible.

    ``top_k`` settles a row by itself unless a pool it left out scores the same as the lowest
    it kept (a tie across the boundary, or fewer than n_pick finite scores): only those rows go
    through ``_pick_tied``, which breaks ties by pool order, ``TIED_ROWS`` rows at a time.
    Memory beyond the scores: the candidates (k x ``BLOCK`` per row), and for tied rows a copy
    of ``TIED_ROWS`` rows with ``_pick_tied``'s masks and counts (28 bytes per pool)."""
    B, C, N = I_BCN.shape
    out = torch.full((B, C, n_pick), -1, dtype=torch.long, device=I_BCN.device)
    if n_pick == 0 or N == 0:
        return out
    k = min(n_pick, N)
    vals_BCk, pools_BCk, tied_BC = top_k(I_BCN, k)
    # kept pools with a -inf score are not visible (only possible when k == N): drop them
    pools_BCk = torch.where(vals_BCk > float("-inf"), pools_BCk, N).sort(dim=-1).values
    out[..., :k] = pools_BCk.masked_fill_(pools_BCk == N, -1)
    if bool(tied_BC.any()):
        rows = tied_BC.flatten().nonzero().squeeze(1)
        for part in rows.split(TIED_ROWS):  # bounds _pick_tied's masks to TIED_ROWS rows
            out.view(B * C, n_pick)[part] = _pick_tied(I_BCN.reshape(B * C, N)[part], n_pick)
    return out


def top_k(I_BCN: torch.Tensor, k: int):
    """The k largest scores per row, their pools (in no order) and whether the row is tied:
    another pool scores the k-th largest value too, so which one is kept is not settled.

    Pre-filter (exact): the first nb x b pools of a row form nb blocks of b pools, block j
    holding pools j, j + nb, j + 2 nb, ... (a strided block, so that its maximum is an
    elementwise maximum of b contiguous slices). Every one of the row's k largest scores lies
    in the k blocks with the largest maxima or in the last N - nb x b pools: a block outside
    them has a maximum no larger than the k-th block maximum, which k blocks reach. So top-k
    runs on k x b + (N - nb x b) candidates instead of the whole row. A block left out whose
    maximum equals the k-th largest score is a tie."""
    B, C, N = I_BCN.shape
    b = min(BLOCK, N // (4 * k))
    if b < 2:
        vals_BCk, pools_BCk = I_BCN.topk(k, dim=-1, sorted=False)
        tied_BC = (I_BCN >= vals_BCk.amin(-1, keepdim=True)).sum(-1) > k
        return vals_BCk, pools_BCk, tied_BC
    nb = N // b
    I_BCbn = I_BCN[..., : nb * b].view(B, C, b, nb)
    max_BCn = I_BCbn.amax(2)
    blocks_BCk = max_BCn.topk(k, dim=-1, sorted=False).indices
    cand = torch.cat([I_BCbn.gather(3, blocks_BCk[:, :, None].expand(B, C, b, k)).flatten(2),
                      I_BCN[..., nb * b:]], dim=-1)  # [B, C, b k + rest]
    vals_BCk, j_BCk = cand.topk(k, dim=-1, sorted=False)
    in_block = j_BCk < b * k
    pools_BCk = torch.where(in_block, (j_BCk // k) * nb + blocks_BCk.gather(-1, j_BCk.remainder(k)),
                            nb * b + j_BCk - b * k)
    thr_BC1 = vals_BCk.amin(-1, keepdim=True)
    tied_BC = ((cand >= thr_BC1).sum(-1) > k) | ((max_BCn >= thr_BC1).sum(-1) > k)
    return vals_BCk, pools_BCk, tied_BC


def _pick_tied(I_RN: torch.Tensor, n_pick: int) -> torch.Tensor:
    """``pick_pools`` for rows [R, N] with ties at the boundary: the pools above the row's
    n_pick-th score, then the tied ones in pool order until n_pick are chosen."""
    R, N = I_RN.shape
    out = torch.full((R, n_pick + 1), -1, dtype=torch.long, device=I_RN.device)
    k = min(n_pick, N)
    thr_R1 = I_RN.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    finite = I_RN > float("-inf")
    above = (I_RN > thr_R1) & finite
    tied = (I_RN == thr_R1) & finite
    need_R1 = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(-1) <= need_R1))
    slot = chosen.cumsum(-1) - 1  # position of each chosen pool among the chosen, ascending
    slot = torch.where(chosen, slot, n_pick)  # unchosen pools write to a dropped column
    out.scatter_(-1, slot, torch.arange(N, device=I_RN.device).expand(R, N))
    return out[:, :n_pick]


def expand_to_tokens(pools_BCP, t0: int, *, kpool: int, topk: int):
    """Pool ids [B, C, P] -> token slots [B, C, S] (int32) in the layout of the module docstring."""
    B, C, P = pools_BCP.shape
    dev = pools_BCP.device
    tok_BCPK = pools_BCP[..., None] * kpool + torch.arange(kpool, device=dev)
    tok_BCPK = tok_BCPK.masked_fill(pools_BCP[..., None] < 0, -1)
    pad = torch.full((B, C, topk - P * kpool), -1, dtype=torch.long, device=dev)
    t_C = torch.arange(t0, t0 + C, device=dev)
    start_C = t_C + 1 - (t_C + 1) % kpool
    tail_CJ = start_C[:, None] + torch.arange(kpool - 1, device=dev)
    tail_CJ = tail_CJ.masked_fill(tail_CJ > t_C[:, None], -1)
    return torch.cat([tok_BCPK.flatten(2), tail_CJ.expand(B, C, kpool - 1), pad], dim=-1).to(SELECTION_DTYPE)


def selection_pools(idx_BTS: torch.Tensor, *, kpool: int, topk: int, seq_len: int | None = None) -> torch.Tensor:
    """The pools of a ``select_tokens`` result, [B, T, P] int32 (-1 = none): the compact form
    (4 bytes per selected pool instead of 8 per slot) that ``selection_tokens`` expands back.
    ``seq_len``: the whole sequence's length when idx holds some of its queries (default T)."""
    T = idx_BTS.shape[1] if seq_len is None else seq_len
    P = min(topk // kpool, T // kpool)
    first_BTP = idx_BTS[..., : P * kpool : kpool]
    return torch.where(first_BTP >= 0, first_BTP // kpool, -1).to(torch.int32)


EXPAND_ELEMENTS = 1 << 20  # slots expanded at a time by selection_tokens (8 MiB of int64 transients)


def selection_tokens(pools_BTP: torch.Tensor, *, kpool: int, topk: int, rows: int | None = None) -> torch.Tensor:
    """``select_tokens``' index [B, T, S] from its pools (``selection_pools``), ``rows`` queries
    at a time (default: ``EXPAND_ELEMENTS`` slots) so the transients stay a block's size."""
    B, T, _ = pools_BTP.shape
    S = slot_width(topk, kpool)
    rows = rows or max(1, EXPAND_ELEMENTS // (B * S))
    idx_BTS = torch.empty(B, T, S, dtype=SELECTION_DTYPE, device=pools_BTP.device)
    for t0 in range(0, T, rows):
        part = pools_BTP[:, t0 : t0 + rows].long()
        idx_BTS[:, t0 : t0 + part.shape[1]] = expand_to_tokens(part, t0, kpool=kpool, topk=topk)
    return idx_BTS


def torch_scores(q_BCHD, kp_BND, w_BCH, t0, scale, kpool):
    return pool_scores_chunk(q_BCHD, kp_BND, w_BCH, t0, scale, kpool)


def query_range(queries: tuple[int, int] | None, T: int, chunk: int) -> tuple[int, int]:
    """The queries ``select_tokens`` selects for: all of them, or ``queries`` = (first, end),
    first a multiple of ``chunk`` so that every chunk is the one a whole-sequence call scores
    (the same products, hence the same selection bit for bit, ties included)."""
    if queries is None:
        return 0, T
    q0, q1 = queries
    if not (0 <= q0 <= q1 <= T and q0 % chunk == 0):
        raise ValueError(f"select_tokens: queries {queries} must lie in [0, {T}] and start at a multiple of the "
                         f"query chunk ({chunk})")
    return q0, q1


@torch.no_grad()
def select_tokens(q_BTHD, k_BTD, w_BTH, gate_BTD=None, ape_KD=None, *, kpool: int, topk: int,
                  scale: float | None = None, chunk: int = 64, score_fn: ScoreFn = torch_scores,
                  use_native: bool = False, queries: tuple[int, int] | None = None):
    """Selected token indices [B, T, S] (int32, -1 = empty) and validity mask [B, T, S].

    q [B, T, Hi, D] indexer queries; k [B, T, D] indexer keys (shared by the heads);
    w [B, T, Hi] head weights (transformers: ``weights_proj(x) * Hi**-0.5``);
    gate [B, T, D] pool gate logits (``x @ index_kpool_compress_gate.T``); ape [kpool, D];
    scale defaults to D**-0.5. S = topk + kpool - 1.
    ``use_native`` (the backend's ``native``): scores and top-k in C (``cpu/dsa.c``, fp32) when
    the torch scores are asked for and the inputs are CPU tensors not in fp64.
    ``queries`` = (first, end): select for those queries only ([B, end - first, S]) over the
    whole sequence's pools, as the whole call would (see ``query_range``)."""
    B, T, _, D = q_BTHD.shape
    q0, q1 = query_range(queries, T, chunk)
    scale = D**-0.5 if scale is None else scale
    kp_BND = pool_keys(k_BTD, gate_BTD, ape_KD, kpool=kpool)
    idx_BTS = select_from_pools(q_BTHD[:, q0:q1], kp_BND, w_BTH[:, q0:q1], kpool=kpool, topk=topk, scale=scale,
                                n_pick=min(topk // kpool, kp_BND.shape[1]), t0=q0, chunk=chunk, score_fn=score_fn,
                                use_native=use_native)
    return idx_BTS, idx_BTS >= 0


@torch.no_grad()
def select_from_pools(q_BTHD, kp_BND, w_BTH, *, kpool: int, topk: int, scale: float, n_pick: int, t0: int = 0,
                      chunk: int = 64, score_fn: ScoreFn = torch_scores, use_native: bool = False):
    """Selected tokens [B, T, S] of queries t0 .. t0+T-1 from the pooled keys complete so far
    (kp [B, N, D]), ``n_pick`` pool slots (``min(topk // kpool, pools of the whole sequence)``):
    ``select_tokens``' layout. The queries are scored in blocks that end at multiples of
    ``chunk`` (absolute positions), so a chunked prefill that calls this chunk by chunk scores
    the blocks a whole-sequence call scores and gets its selection bit for bit. ``use_native``:
    in C (``native_select``, per query) when the torch scores are asked for."""
    B, T = q_BTHD.shape[:2]
    if use_native and score_fn is torch_scores and native.usable(q_BTHD, kp_BND, w_BTH):
        return native_select(q_BTHD, kp_BND, w_BTH, kpool=kpool, topk=topk, scale=scale, n_pick=n_pick, t0=t0)
    idx_BTS = torch.empty(B, T, slot_width(topk, kpool), dtype=SELECTION_DTYPE, device=q_BTHD.device)
    a0 = t0
    while a0 < t0 + T:
        a1 = min((a0 // chunk + 1) * chunk, t0 + T)
        # Pools ending after a1 - 1 are invisible to the whole block: skip them.
        n_visible = min(kp_BND.shape[1], a1 // kpool)
        rows = slice(a0 - t0, a1 - t0)
        scores = score_fn(q_BTHD[:, rows], kp_BND[:, :n_visible], w_BTH[:, rows], a0, scale, kpool)
        pools = pick_pools(scores, min(n_pick, n_visible))
        if pools.shape[-1] < n_pick:
            pools = torch.nn.functional.pad(pools, (0, n_pick - pools.shape[-1]), value=-1)
        idx_BTS[:, rows] = expand_to_tokens(pools, a0, kpool=kpool, topk=topk)
        a0 = a1
    return idx_BTS


def native_select(q_BTHD, kp_BND, w_BTH, *, kpool: int, topk: int, scale: float, n_pick: int, t0: int = 0):
    """Selected tokens [B, T, S] of queries t0 .. t0+T-1 from the pooled keys complete so far
    (kp [B, N, D]), in C (``cpu/dsa.c``), threads over query rows: ``select_tokens``' layout with
    ``n_pick`` pool slots (``min(topk // kpool, pools of the whole sequence)``). A chunked prefill
    calls it chunk by chunk and gets the whole sequence's selection."""
    lib = native.library("dsa")
    B, T, Hi, Di = q_BTHD.shape
    N = kp_BND.shape[1]
    qi, w = native.f32(q_BTHD), native.f32(w_BTH)
    kpT = kp_BND.to(torch.float32).transpose(1, 2).contiguous()  # [B, Di, N]
    idx_BTS = torch.empty(B, T, slot_width(topk, kpool), dtype=SELECTION_DTYPE)
    p = native.ptr
    native.run_rows(lib.dsa_select_tokens, native.split_rows(B * T), lambda i, r0, r1: (
        p(qi), p(kpT), p(w), r0, r1, T, N, Hi, Di, kpool, topk, n_pick, t0, scale, p(idx_BTS)))
    return idx_BTS
