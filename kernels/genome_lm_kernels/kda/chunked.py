"""Kimi Delta Attention in chunks of 64 tokens: the CPU-efficient torch path.

Inside a chunk (positions i, j = 0..63, entering state S0 [K, V], G_i = g_0 + ... + g_i the
in-chunk cumulative log-decay, all per channel), unrolling the recurrence gives

    delta_i = beta_i (v_i - S0^T (e^{G_i} k_i) - sum_{j<i} (k_i . e^{G_i - G_j} k_j) delta_j)

i.e. (I + A) delta = beta (v - (e^G k) S0) with A_ij = beta_i k_i . e^{G_i - G_j} k_j (j < i).
With Tinv = (I + A)^{-1} (the UT transform) and the WY pair U = Tinv beta v,
W = Tinv beta e^G k:

    delta = U - W S0
    o     = (e^G q) S0 + M delta,            M_ij = q_i . e^{G_i - G_j} k_j  (j <= i)
    S_end = e^{G_last} S0 + (e^{G_last - G} k)^T delta

Everything depending only on the chunk (A, M, Tinv, W, U) is computed for all chunks at once;
only S0 -> S_end runs as a loop over chunks, in fp32, written as S_end = T_c S0 + b_c with the
chunk's transition T_c = Diag(e^{G_last}) - (e^{G_last - G} k)^T W and b_c = (e^{G_last - G} k)^T U
made beforehand for all chunks: one fused product-add per chunk (the deltas and outputs then
come from the stacked entering states in two batched products). Against a loop of 3 products
and 2 adds per chunk, with slices whose gradients autograd scattered into zero-filled copies,
KDA's forward + backward at T = 8k (4 heads of 16) went, with the blocked inverse below, from
118 to 98 ms (min of 10, 2 threads; 22.4 to 20.9 ms for 8 x 256).

The pairwise e^{G_i - G_j} is per channel, so A and M are not a plain matmul. In 16-row
sub-chunks, the exponent is split at a reference row r, e^{G_i - G_r} e^{G_r - G_j}, which makes
each sub-chunk's rows one matmul. With r the middle row this needs the decay inside a sub-chunk
to stay moderate (true for glm5_next's safe gate); for stronger decays an exact form takes over:
r the sub-chunk's first row for the blocks left of it (both factors <= 1) and the 16 x 16
diagonal blocks formed element by element.

The in-chunk cumulative decay G is summed in fp64 and only differences of it are cast to fp32
before exp: with strong decays (-60 per token) G reaches -4,000 within a chunk, where fp32 keeps
only 4 digits of G_i - G_j and the gradient of g lost them (2e-5 relative error; 1e-7 now).

fp32 exp is 10x slower where its result falls below fp32's normal range, as e^G does for half of
a chunk at decays of -5 per token: exponents are floored at -87 (``exp32``). That, the diagonal
added in place and each pairwise product made by its own matmul (no [N, 2, C, C] copy, and M
kept alone) left the outputs bit for bit as they were and made the forward 1.5x faster (T = 4096,
4 heads of 16, one thread, no gradient: 26 to 17 ms).

Backward is written by hand (``chunked_bwd``), one autograd node per group of GROUP chunks: it
keeps the group's inputs, W, U, M, Tinv and the entering states, (4K + 2V + 1 + 128) floats
per (token, head) plus K V / 64, recomputes the elementwise factors and forms the gradients in
batched products; the pairwise temporaries (4 x T x K, 16 x T x K when exact) exist for one
group at a time, as in forward. ``kda_chunked_autograd`` runs the same forward with autograd's
backward, the preparation recomputed under activation checkpointing: the independent check of
the hand-written one, and its baseline (forward + backward 1.7-1.9x slower at T = 4096, 4 heads
of 16, 1 or 2 threads; ``benchmarks/bench_kda_cpu.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK = 64
SUB = 16  # rows per sub-chunk for the pairwise decays
MAX_EXP = 60.0  # largest exponent a factorised decay may take (e^60 ~ 1e26, fp32 tops at e^88)
GROUP = 128  # chunks (all batch rows and heads together) per streamed group (one backward node)
EXP_FLOOR = -87.0  # e^-87 ~ 1.6e-38, just above fp32's smallest normal number


def exp32(x: torch.Tensor, ceiling: float | None = None) -> torch.Tensor:
    """e^x in fp32 (x fp32 or fp64, clamped to ceiling when given), the exponent floored at EXP_FLOOR.

    fp32 exp is 10x slower where its result falls below the normal range, as e^G does for half of
    a chunk at decays of -5 per token; a factor of e^-87 in place of a smaller one moves nothing:
    it meets factors of at most e^{MAX_EXP}, 1e-12 against the O(1) terms beside it."""
    return x.float().clamp(EXP_FLOOR, ceiling).exp()


def needs_exact(G_NCK: torch.Tensor) -> bool:
    """Whether the split at each sub-chunk's middle row would take a factor above e^{MAX_EXP}:
    the decay from a sub-chunk's first row to its middle row, or from there to its last row."""
    N, C, K = G_NCK.shape
    G = G_NCK.view(N, C // SUB, SUB, K)
    ref = G[:, :, SUB // 2 : SUB // 2 + 1]
    return bool(torch.maximum(G[:, :, 0:1] - ref, ref - G[:, :, -1:]).max() > MAX_EXP)


def _pairwise(k_NCK: torch.Tensor, q_NCK: torch.Tensor, G_NCK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each chunk, P_ij = sum_d a_i[d] k_j[d] exp(G_i[d] - G_j[d]) for j <= i (0 above),
    with a = k and with a = q: two [N, C, C]. Both share the decay factors, so they are made once.

    Split at each 16-row sub-chunk's middle row r, e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j} is
    one matmul per sub-chunk; it is safe while no factor exceeds e^{MAX_EXP}, i.e. while the decay
    from a sub-chunk's first row to r, and from r to its last row, stays under MAX_EXP (always for
    glm5_next's safe gate, bound -5: at most 8 x 5 = 40). Otherwise the exact form is used.
    """
    N, C, K = k_NCK.shape
    if needs_exact(G_NCK):
        return _pairwise_exact(k_NCK, q_NCK, G_NCK)
    nsub = C // SUB
    G = G_NCK.view(N, nsub, SUB, K)
    ref = G[:, :, SUB // 2 : SUB // 2 + 1]  # [N, nsub, 1, K]
    e_in = (G - ref).float().exp()  # [N, nsub, SUB, K]
    # Columns after the sub-chunk are masked below; the clamp keeps their factors finite.
    k_out_t = (k_NCK[:, None] * exp32(ref - G_NCK[:, None], MAX_EXP)).transpose(-1, -2)  # [N, nsub, K, C]

    def rows(a_NCK: torch.Tensor) -> torch.Tensor:  # one sub-chunk of rows per matmul: [N, C, C]
        P = ((a_NCK.view(N, nsub, SUB, K) * e_in) @ k_out_t).view(N, C, C)
        # Keep j < i only. Above the diagonal the factors need not cancel (e^{G_i - G_j} >= 1
        # there, even inf): select, never multiply by a 0/1 mask, so those entries stay out of the
        # gradient. The diagonal (e^0 = 1) is added without the split: through the split, its
        # O(1) gradients into G_i and G_r cancel only up to rounding, which swamped the true
        # gradient of g (e^{g} times smaller) by 1e-4 at g = -7.4.
        P = P.tril(-1)  # a select (zeros written above the diagonal), not a 0/1 product
        P.diagonal(dim1=-2, dim2=-1).add_((a_NCK * k_NCK).sum(-1))
        return P

    return rows(k_NCK), rows(q_NCK)


def _pairwise_exact(k_NCK: torch.Tensor, q_NCK: torch.Tensor, G_NCK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_pairwise`` for any decay: blocks left of a sub-chunk split at its first row (both factors
    <= 1), the 16 x 16 diagonal blocks formed exactly (16 x T x K floats)."""
    N, C, K = k_NCK.shape
    nsub = C // SUB
    k, G = k_NCK.view(N, nsub, SUB, K), G_NCK.view(N, nsub, SUB, K)
    kq = torch.stack([k, q_NCK.view(N, nsub, SUB, K)], 2)  # [N, nsub, 2, SUB, K]
    ref = G[:, :, None, :1]  # [N, nsub, 1, 1, K]: the first row of each sub-chunk
    # Columns before the sub-chunk: e^{G_r - G_j} <= 1 there; the clamp only touches columns that
    # the mask drops (at or after the sub-chunk), keeping inf out of the matmul.
    kq_in = kq * exp32(G[:, :, None] - ref)
    k_out = k_NCK[:, None] * exp32(ref[:, :, 0] - G_NCK[:, None], 0.0)  # [N, nsub, C, K]
    off = kq_in.flatten(2, 3) @ k_out.transpose(-1, -2)  # [N, nsub, 2*SUB, C]
    col_sub = torch.arange(C, device=k.device) // SUB
    before = col_sub[None, :] < torch.arange(nsub, device=k.device)[:, None]  # [nsub, C]
    off = off.view(N, nsub, 2, SUB, C) * before[None, :, None, None, :]
    # Diagonal 16 x 16 blocks, exact; the exponent above the diagonal is masked to -inf (-> 0).
    tril = torch.ones(SUB, SUB, dtype=torch.bool, device=k.device).tril()
    expo = (G[:, :, :, None, :] - G[:, :, None, :, :]).float().masked_fill(~tril[..., None], float("-inf"))
    k_decayed = k[:, :, None, :, :] * expo.exp()  # [N, nsub, SUB_i, SUB_j, K]
    diag = kq.transpose(2, 3) @ k_decayed.transpose(-1, -2)  # [N, nsub, SUB_i, 2, SUB_j]
    eye_sub = torch.eye(nsub, dtype=diag.dtype, device=k.device)
    diag = diag.permute(0, 1, 3, 2, 4)[:, :, :, :, None, :] * eye_sub[:, None, None, :, None]
    P = (off + diag.reshape(N, nsub, 2, SUB, C)).transpose(1, 2).reshape(N, 2, C, C)
    return P[:, 0], P[:, 1]


class _UnitLowerInverse(torch.autograd.Function):
    """(I + A)^{-1} for strictly lower triangular A [N, C, C], by forward substitution (batched
    triangular solves are slow on CPU here); backward: dA = -(Y^T dY Y^T), strictly lower.

    Blocked: the SUB x SUB diagonal blocks are inverted together (SUB - 1 sequential steps on all
    N * C / SUB blocks), then each block row below the first gets its left part from the inverse
    of the rows above, Y_rc = -Y_rr A_rc Y_cc (C / SUB - 1 steps): 18 steps for C = 64 instead
    of 63, about 2x faster at the same rounding (1.6e-7 vs 1.9e-7 from a float64 inverse)."""

    @staticmethod
    def forward(ctx, A_NCC: torch.Tensor) -> torch.Tensor:
        N, C, _ = A_NCC.shape
        n = C // SUB
        D = A_NCC.view(N, n, SUB, n, SUB).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(N * n, SUB, SUB)
        Yd = torch.eye(SUB, dtype=A_NCC.dtype, device=A_NCC.device).repeat(N * n, 1, 1)
        for i in range(1, SUB):  # row i of a block: e_i - sum_{j<i} A_ij Y_j
            Yd[:, i : i + 1, :i] -= D[:, i : i + 1, :i] @ Yd[:, :i, :i]
        Yd = Yd.view(N, n, SUB, SUB)
        Y = torch.zeros_like(A_NCC)
        Y[:, :SUB, :SUB] = Yd[:, 0]
        for b in range(1, n):
            r, c = slice(b * SUB, (b + 1) * SUB), slice(0, b * SUB)
            Y[:, r, r] = Yd[:, b]
            Y[:, r, c] = -(Yd[:, b] @ (A_NCC[:, r, c] @ Y[:, c, c]))
        ctx.save_for_backward(Y)
        return Y

    @staticmethod
    def backward(ctx, dY: torch.Tensor) -> torch.Tensor:
        (Y,) = ctx.saved_tensors
        Yt = Y.transpose(-1, -2)
        return -(Yt @ dY @ Yt).tril(-1)


def prepare(q, k, v, G, beta):
    """Per-chunk quantities for N chunks ([N, 64, .] in, fp32): W, U, M, e^G q, e^{G_last-G} k,
    e^{G_last}, and the UT transform Tinv that made W and U."""
    C = k.shape[1]
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    P_kk, M = _pairwise(k, q, G)
    Tinv = _UnitLowerInverse.apply(P_kk * strict * beta[..., None])
    eG = exp32(G)
    W = Tinv @ (beta[..., None] * eG * k)
    U = Tinv @ (beta[..., None] * v)
    G_last = G[:, -1:]
    return W, U, M, q * eG, k * exp32(G_last - G), exp32(G_last.squeeze(1)), Tinv


def _chunk_prepare(q, k, v, G, beta):
    """``prepare`` without Tinv: what the autograd path checkpoints."""
    return prepare(q, k, v, G, beta)[:6]


def carry(W, U, M, Qg, Kd, decay, S):
    """Carry the state S [B, H, K, V] through a group's chunks ([B * H * nc, 64, .] in, batch rows
    then heads then chunks). Returns (o [B, H, nc, 64, V], entering states [B, H, nc, K, V],
    the state after the last chunk [B, H, K, V])."""
    B, H = S.shape[:2]
    W, U, M, Qg, Kd, decay = (p.view(B, H, -1, *p.shape[1:]) for p in (W, U, M, Qg, Kd, decay))
    # S_end = e^{G_last} S0 + Kd^T (U - W S0) = T_c S0 + b_c, T_c and b_c made for all chunks
    # at once: the loop is one fused product-add per chunk (its backward two products), and
    # unbind hands each step a view whose gradient is stacked once, not scattered into zeros
    Kd_t = Kd.transpose(-1, -2)
    trans = torch.diag_embed(decay) - Kd_t @ W  # T_c [B, H, nc, K, K]
    b = Kd_t @ U  # [B, H, nc, K, V]
    entering = []
    for T_c, b_c in zip(trans.flatten(0, 1).unbind(1), b.flatten(0, 1).unbind(1)):
        entering.append(S)
        S = torch.baddbmm(b_c, T_c, S.flatten(0, 1)).view(B, H, *S.shape[2:])
    S_in = torch.stack(entering, 2)  # [B, H, nc, K, V]: the state entering each chunk
    return Qg @ S_in + M @ (U - W @ S_in), S_in, S


def kda_chunked(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float,
    initial_state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kda_reference``: (o [B, T, H, V] fp32, final state [B, H, K, V] fp32).

    Any T: the tail is padded to a whole chunk with g = 0, beta = 0, k = 0, which leaves the
    state untouched, and the padded outputs are dropped. Backward is ``chunked_bwd``'s, one
    group of chunks at a time.
    """
    from .chunked_bwd import ChunkGroup  # built on this module's forward pieces

    return _run_groups(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, ChunkGroup.apply)


def kda_chunked_autograd(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float,
    initial_state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_chunked`` with autograd's backward through the same forward (``prepare`` recomputed
    under activation checkpointing): the independent check of ``chunked_bwd``, and its baseline."""
    return _run_groups(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, _group_autograd)


def _group_autograd(q, k, v, g, beta, S):
    """One group of chunks ([N, 64, .], N = B * H * nc) from the state S [B, H, K, V]:
    (o [B, H, nc, 64, V], S after the group)."""
    G = g.double().cumsum(1)  # G in fp64: differences of long sums keep their digits
    if torch.is_grad_enabled():
        parts = checkpoint(_chunk_prepare, q, k, v, G, beta, use_reentrant=False)
    else:
        parts = _chunk_prepare(q, k, v, G, beta)
    o, _, S = carry(*parts, S)
    return o, S


def _run_groups(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, group_step):
    B, T, H, K = k_BTHK.shape
    V = v_BTHV.shape[-1]
    n = -(-T // CHUNK)
    pad = n * CHUNK - T

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, n, 64, D] fp32
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
        return x.view(B, n, CHUNK, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q_BTHK * scale), chunks(k_BTHK), chunks(v_BTHV), chunks(g_BTHK)
    beta = chunks(beta_BTH[..., None]).squeeze(-1)

    # Stream over groups of chunks in time: prepare a group, then carry the state through it, so
    # temporaries (forward, and backward's) never exceed one group.
    S = q.new_zeros(B, H, K, V) if initial_state_BHKV is None else initial_state_BHKV.float()
    group = max(1, GROUP // (B * H))
    outputs = []
    for c0 in range(0, n, group):
        nc = min(group, n - c0)
        args = [x[:, :, c0 : c0 + nc].reshape(B * H * nc, CHUNK, -1) for x in (q, k, v, g)]
        args.append(beta[:, :, c0 : c0 + nc].reshape(B * H * nc, CHUNK))
        o, S = group_step(*args, S)
        outputs.append(o)  # [B, H, nc, 64, V]
    o = torch.cat(outputs, 2).reshape(B, H, n * CHUNK, V)[:, :, :T].transpose(1, 2)
    return o, S
