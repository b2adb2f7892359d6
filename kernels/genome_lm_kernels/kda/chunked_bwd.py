"""The chunked torch path's backward, by hand: one autograd node per group of chunks.

Forward is ``chunked.py``'s (same operations, same numbers); it keeps the group's inputs, W, U,
M, the UT transform Tinv and the state entering each chunk. Backward recomputes the elementwise
factors (G, e^G, e^{G_last - G}) and, per chunk (all chunks of the group at once but for the
state loop), with delta = U - W S0, X = beta e^G k and Y = beta v (W = Tinv X, U = Tinv Y):

    dS0     = T_c^T dS_end + Qg^T dO - W^T M^T dO        (the state loop, in reverse)
    ddelta  = M^T dO + Kd dS_end
    dM      = dO delta^T (lower),   dQg = dO S0^T,   dKd = delta dS_end^T,   ddecay = rowsum(S0 dS_end)
    dX, dY  = Tinv^T (-ddelta S0^T), Tinv^T ddelta
    dA      = -(Tinv^T dTinv Tinv^T) = -(dX W^T + dY U^T), strictly lower

and then through the pairwise products P_ij = sum_d a_i[d] k_j[d] e^{G_i[d] - G_j[d]}
(a = beta k for A, a = q for M): with the row sums R_i = sum_j dP_ij k_j e^{G_i - G_j} and the
column sums C_j = sum_i dP_ij a_i e^{G_i - G_j}, da = R, dk += C and dG = a R - k C. The
exponent is split at a reference row with the forward's very factors (``chunked._pairwise``),
but the reference row's own gradient, which autograd forms as two O(1) terms that cancel, is never
made; the diagonal (e^0) is kept out of dG altogether. dg is the reverse cumulative sum of dG, in
fp64. Against the fp64 token loop the gradients are as close as autograd's (g: 4e-7 relative at
decays up to 5 per token, 1e-7 to 2.5e-7 at 60).

Saved per (token, head): q, k, g, W (4K floats), v, U (2V), beta, M and Tinv (2 x 64), and K V / 64
for the entering states: 916 bytes at K = V = 16, where autograd through the checkpointed forward
keeps 948 (and kept 1,204 while M was a view into both pairwise products). The pairwise
temporaries exist for one group at a time.
"""

from __future__ import annotations

import torch

from .chunked import MAX_EXP, SUB, carry, exp32, needs_exact, prepare


class ChunkGroup(torch.autograd.Function):
    """One group of chunks: (q, k, v, g [N, 64, K|V], beta [N, 64], S0 [B, H, K, V]) ->
    (o [B, H, nc, 64, V], S after the group), N = B * H * nc, all fp32, q already scaled."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0):
        G = g.double().cumsum(1)  # G in fp64: differences of long sums keep their digits
        W, U, M, Qg, Kd, decay, Tinv = prepare(q, k, v, G, beta)
        o, S_in, S_end = carry(W, U, M, Qg, Kd, decay, S0)
        ctx.save_for_backward(q, k, v, g, beta, W, U, M, Tinv, S_in)
        return o, S_end

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO, dS_last):
        q, k, v, g, beta, W, U, M, Tinv, S_in = ctx.saved_tensors
        B, H, nc, K, V = S_in.shape
        N, C, _ = k.shape
        G = g.double().cumsum(1)
        G_last = G[:, -1:]
        eG, eL = exp32(G), exp32(G_last - G)  # e^G, e^{G_last - G}: [N, C, K], as in forward
        decay = exp32(G_last.squeeze(1))  # [N, K]
        b = beta[..., None]
        Qg, Kd = q * eG, k * eL
        S0 = S_in.view(N, K, V)
        dO = dO.reshape(N, C, V).contiguous()  # o.sum()'s gradient comes expanded (stride 0)
        Mt_dO = M.transpose(-1, -2) @ dO

        # The state loop in reverse: dS0 = T_c^T dS_end + r_c, r_c and T_c^T made for all chunks.
        r = (Qg.transpose(-1, -2) @ dO - W.transpose(-1, -2) @ Mt_dO).view(B * H, nc, K, V)
        trans_t = (torch.diag_embed(decay) - Kd.transpose(-1, -2) @ W).transpose(-1, -2).reshape(B * H, nc, K, K)
        dS = dS_last.flatten(0, 1)
        leaving = []
        for c in reversed(range(nc)):
            leaving.append(dS)
            dS = torch.baddbmm(r[:, c], trans_t[:, c], dS)
        dS_end = torch.stack(leaving[::-1], 1).view(N, K, V)  # gradient of the state leaving each chunk

        delta = U - W @ S0
        d_delta = Mt_dO + Kd @ dS_end
        dM = dO @ delta.transpose(-1, -2)  # only its lower triangle is used
        dQg = dO @ S0.transpose(-1, -2)
        dKd = delta @ dS_end.transpose(-1, -2)
        d_decay = (S0 * dS_end).sum(-1)  # [N, K]
        dWU = torch.cat([-(d_delta @ S0.transpose(-1, -2)), d_delta], -1)
        dXY = Tinv.transpose(-1, -2) @ dWU
        # -(Tinv^T dTinv Tinv^T), strictly lower
        dA = (dXY @ torch.cat([W, U], -1).transpose(-1, -2)).tril_(-1).neg_()
        dX, dY = dXY[..., :K], dXY[..., K:]

        dq, dk, dbeta, dG = _pairwise_grad(k, q, beta, G, dA, dM)
        dq = dq + dQg * eG
        dk = dk + b * eG * dX + eL * dKd
        dbeta = dbeta + (eG * k * dX).sum(-1) + (v * dY).sum(-1)
        dv = b * dY
        dG = dG + (eG * (q * dQg + b * k * dX)).double()
        dg = dG.flip(1).cumsum(1).flip(1)  # G = cumsum(g): dg_t = sum_{i >= t} dG_i
        # G_last - G_i = g_{i+1} + ... + g_last: dg_t += sum_{i < t} Kd_i dKd_i, in fp64 (summed
        # in fp32, these terms cost g 10x its error at decays of 60 per token)
        Kd_dKd = (Kd * dKd).double().cumsum(1)
        dg[:, 1:] += Kd_dKd[:, :-1]
        dg += (decay * d_decay).double()[:, None]  # e^{G_last}: every g of the chunk
        return dq, dk, dv, dg.float(), dbeta, dS.view(B, H, K, V)


def _pairwise_grad(k, q, beta, G, dA, dM):
    """Gradients through A_ij = beta_i P_ij (j < i) and M_ij (j <= i) of ``chunked._pairwise``,
    given dA (strictly lower) and dM (its lower triangle read) [N, C, C]:
    (dq, dk [N, C, K], dbeta [N, C], dG [N, C, K] fp64)."""
    N, C, _ = k.shape
    n = C // SUB
    dM_diag = dM.diagonal(dim1=-2, dim2=-1)[..., None]  # the e^0 terms, kept out of dG
    a = torch.stack([beta[..., None] * k, q], 1)  # [N, 2, C, K]: the rows' operands
    if needs_exact(G):
        # both cotangents by sub-chunk of rows: [N, n, 2, SUB, C]
        D = torch.stack([dA.view(N, n, SUB, C), dM.tril(-1).view(N, n, SUB, C)], 2)
        R, Ccol, dG = _sums_exact(k, a, G, D)
    else:
        R, Ccol, dG = _sums_split(k, a, G, dA, dM.tril(-1))
    dk = beta[..., None] * R[:, 0] + Ccol + dM_diag * q
    dq = R[:, 1] + dM_diag * k
    dbeta = (k * R[:, 0]).sum(-1)
    return dq, dk, dbeta, dG


def _sums_split(k, a, G, dA, dM):
    """R [N, 2, C, K], C [N, C, K] (see the module docstring) and dG [N, C, K] fp64 for dA and the
    strictly lower dM, with ``_pairwise``'s split at each sub-chunk's middle row r, and its very
    factors (rounding them the backward's own way cost g 1.4x its error):
    R_i = e^{G_i - G_r} sum_j D_ij (k_j e^{G_r - G_j}) and C_j = sum over sub-chunks of
    e^{G_r - G_j} sum_i D_ij (a_i e^{G_i - G_r}). One sub-chunk of rows at a time, with only
    the columns up to its end (D is zero right of them): 10 of the 16 blocks, and no [N, 4, C, K]
    temporaries.

    Each pairwise term t_ij enters dG_i and dG_j with opposite signs, so they cancel in dg's
    cumulative sum wherever both lie past the token, and dg is a fraction (a fifth at decays up
    to 5 per token) of either sum. A sub-chunk's row and column sums, rounded apart in fp32,
    differ by eps; taking eps off at its reference row (where autograd's split put the gradient
    of G_r, which is that) restores their balance: g's error is autograd's, not 1.4x it."""
    N, C, K = k.shape
    n = C // SUB
    Gs = G.view(N, n, SUB, K)
    a5 = a.view(N, 2, n, SUB, K)
    R, dG_rows = [], []
    Ccol = torch.zeros_like(k)
    dG_cols = torch.zeros(N, C, K, dtype=torch.float64, device=k.device)
    for s in range(n):
        start, end = s * SUB, (s + 1) * SUB
        ref = Gs[:, s, SUB // 2 : SUB // 2 + 1]  # [N, 1, K]
        e_in = (Gs[:, s] - ref).float().exp()[:, None]  # [N, 1, SUB, K]
        e_out = exp32(ref - G[:, :end], MAX_EXP)  # [N, end, K]
        D = torch.stack([dA[:, start:end, :end], dM[:, start:end, :end]], 1).view(N, 2 * SUB, end)
        R_s = (D @ (k[:, :end] * e_out)).view(N, 2, SUB, K) * e_in
        C_s = (D.transpose(-1, -2) @ (a5[:, :, s] * e_in).view(N, 2 * SUB, K)) * e_out  # [N, end, K]
        Ccol[:, :end] += C_s
        cols = (k[:, :end] * C_s).double()
        dG_cols[:, :end] += cols
        rows = (a5[:, :, s] * R_s).sum(1, dtype=torch.float64)  # [N, SUB, K]
        rows[:, SUB // 2] -= rows.sum(1) - cols.sum(1)  # eps, at r
        dG_rows.append(rows)
        R.append(R_s)
    return torch.stack(R, 2).view(N, 2, C, K), Ccol, torch.cat(dG_rows, 1) - dG_cols


def _sums_exact(k, a, G, D):
    """``_sums_split`` for any decay, as ``_pairwise_exact`` (D [N, n, 2, SUB, C], whole rows of
    sub-chunks): columns before a sub-chunk split at its first row (both factors <= 1), the
    16 x 16 diagonal blocks formed exactly ([N, n, 16, 16, K] temporaries, fp64 among them)."""
    N, C, K = k.shape
    n = C // SUB
    Gs = G.view(N, n, SUB, K)
    ref = Gs[:, :, :1]
    e_in = exp32(Gs - ref)[:, :, None]  # [N, n, 1, SUB, K], <= 1
    e_out = exp32(ref - G[:, None], 0.0)  # [N, n, C, K]; masked where clamped
    col_sub = torch.arange(C, device=k.device) // SUB
    before = col_sub[None, :] < torch.arange(n, device=k.device)[:, None]  # [n, C]
    D_off = (D * before[None, :, None, None, :]).reshape(N, n, 2 * SUB, C)
    R = (D_off @ (k[:, None] * e_out)).view(N, n, 2, SUB, K) * e_in
    a5 = a.view(N, 2, n, SUB, K).transpose(1, 2)  # [N, n, 2, SUB, K]
    C_by_sub = (D_off.transpose(-1, -2) @ (a5 * e_in).reshape(N, n, 2 * SUB, K)) * e_out  # [N, n, C, K]
    # Diagonal blocks: E_ij = e^{G_i - G_j} (0 above the diagonal), [N, n, SUB_i, SUB_j, K].
    tril = torch.ones(SUB, SUB, dtype=torch.bool, device=k.device).tril()
    E = (Gs[:, :, :, None] - Gs[:, :, None]).float().masked_fill(~tril[..., None], float("-inf")).exp()
    Dd = D.reshape(N, n, 2, SUB, n, SUB).diagonal(dim1=1, dim2=4).permute(0, 4, 2, 1, 3)  # [N, n, i, 2, j]
    R_d = Dd @ (k.view(N, n, 1, SUB, K) * E)  # [N, n, i, 2, K]
    ZE = (Dd.transpose(-1, -2) @ a5.transpose(2, 3)) * E  # [N, n, i, j, K]: both operands summed
    # dG: the blocks' terms t_ij = ZE_ij k_j paired in fp64 (+t_ij at i, -t_ij at j, as autograd
    # does through the exact exponent: the pairs cancel in dg's cumulative sum exactly; their
    # fp32 row and column sums made g's error 2x autograd's at decays of 60 per token), the
    # columns left of the blocks balanced as in _sums_split, at each sub-chunk's first row
    t = (ZE * k.view(N, n, 1, SUB, K)).double()
    rows = (a * R.transpose(1, 2).reshape(N, 2, C, K)).sum(1, dtype=torch.float64)  # [N, C, K]
    cols = (k[:, None] * C_by_sub).double()  # [N, n, C, K]
    dG = rows - cols.sum(1) + (t.sum(3) - t.sum(2)).view(N, C, K)
    dG.view(N, n, SUB, K)[:, :, 0] -= rows.view(N, n, SUB, K).sum(2) - cols.sum(2)  # eps
    R = (R + R_d.transpose(2, 3)).transpose(1, 2).reshape(N, 2, C, K)
    return R, C_by_sub.sum(1) + ZE.sum(2).reshape(N, C, K), dG
