"""Kimi Delta Attention backward in Triton (see ``triton_fwd.py`` for the forward and notation).

The backward recomputes the forward's chunk buffers (G, M, P, Y, W, U, the states h entering
each chunk and delta), then runs three kernels. Per chunk, with S0 = h_c entering, dS the
gradient of the state leaving it and do the output gradient:

    d_delta = M^T do + Kd dS            dS0 = e^{G_last} dS + Qg^T do - W^T d_delta
    dM = do delta^T   dW = -d_delta S0^T   dQg = do S0^T   dKd = delta dS^T   d(e^{G_last}) = rowsum(S0 * dS)

  ``_state_bwd_kernel``  the chunks in reverse, one program per (batch*head, V block) with dS in
                         fp32 registers: stores dS of every chunk (dh) and d_delta;
  ``_dqkw_kernel``       one program per chunk: the products above (sums over V), dv, then back
                         through W = Y Xw, U = Y Xu and Y = (I + A)^{-1}: dA = -(Y^T dY Y^T);
  ``_intra_bwd_kernel``  one program per (chunk, block of K): dq, dk, dg through e^G q,
                         e^{G_last - G} k, e^{G_last}, Xw = beta e^G k and the pairwise M and P
                         (the sub-chunk split of the forward, both factors <= 1; diagonal blocks
                         exact). The pairwise decays' gradient uses dG_i = q_i dq_i - k_i dk_i
                         over the off-diagonal terms only: the diagonal (e^0) carries no decay,
                         so no O(1) terms cancel there. dg is the reverse cumulative sum of dG,
                         plus the exclusive prefix sum of dKd * Kd (Kd_i depends on g_m for
                         m > i; summed over rows shifted by one, never as cumsum - self) and
                         d(e^{G_last}) e^{G_last}.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_fwd import decay_le1, mm, to_buffer, token_rows


@triton.jit
def _state_bwd_kernel(Qg_ptr, Kd_ptr, decay_ptr, W_ptr, M_ptr, do_ptr, dsT_ptr, dh_ptr, ddelta_ptr, ds0_ptr, T, NT, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      DOT: tl.constexpr):
    vb, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = tl.arange(0, BT)
    ck, cv = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    state = (bh * K + ck)[:, None] * V + cv[None, :]
    m_state = mk[:, None] & mv[None, :]
    dS = tl.load(dsT_ptr + state, mask=m_state, other=0.0).to(tl.float32)
    for cc in range(0, NT):
        c = NT - 1 - cc
        row0 = bh * NT * BT + c * BT
        t = c * BT + rows
        tl.store(dh_ptr + ((bh * NT + c) * K + ck)[:, None] * V + cv[None, :], to_buffer(dS, dh_ptr, DOT),
                 mask=m_state)
        at_k = (row0 + rows)[:, None] * K + ck[None, :]
        Qg = tl.load(Qg_ptr + at_k, mask=mk[None, :], other=0.0)
        Kd = tl.load(Kd_ptr + at_k, mask=mk[None, :], other=0.0)
        decay = tl.load(decay_ptr + (bh * NT + c) * K + ck, mask=mk, other=0.0)
        W = tl.load(W_ptr + (row0 + rows)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        M = tl.load(M_ptr + (row0 + rows)[:, None] * BT + rows[None, :])
        do = tl.load(do_ptr + token_rows(b, h, t, T, H)[:, None] * V + cv[None, :],
                     mask=(t < T)[:, None] & mv[None, :], other=0.0)
        d_delta = mm(tl.trans(M), do, DOT) + mm(Kd, dS, DOT)
        tl.store(ddelta_ptr + (row0 + rows)[:, None] * V + cv[None, :], to_buffer(d_delta, ddelta_ptr, DOT),
                 mask=mv[None, :])
        dS = decay[:, None] * dS + mm(tl.trans(Qg), do, DOT) - mm(tl.trans(W), d_delta, DOT)
    tl.store(ds0_ptr + state, dS, mask=m_state)


@triton.jit
def _dqkw_kernel(v_ptr, k_ptr, beta_ptr, G_ptr, Y_ptr, P_ptr, h_ptr, dh_ptr, vnew_ptr, ddelta_ptr, do_ptr,
                 dW_ptr, dQg_ptr, dKd_ptr, ddecay_ptr, dM_ptr, dA_ptr, dv_ptr, dbeta_ptr, T, H,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 DOT: tl.constexpr):
    """One chunk: dM, dv, dW, dQg, dKd, d(e^{G_last}), dA (strictly lower) and the beta gradient
    through U and A (the part through W is added by ``_intra_bwd_kernel``)."""
    c, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NT = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows = tl.arange(0, BT)
    t = c * BT + rows
    in_t = t < T
    row0 = bh * NT * BT + c * BT
    beta = tl.load(beta_ptr + token_rows(b, h, t, T, H), mask=in_t, other=0.0).to(tl.float32)
    Y = tl.load(Y_ptr + (row0 + rows)[:, None] * BT + rows[None, :])
    dY = tl.zeros([BT, BT], dtype=tl.float32)
    dM = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        mv = cv < V
        tok_v = token_rows(b, h, t, T, H)[:, None] * V + cv[None, :]
        d_delta = tl.load(ddelta_ptr + (row0 + rows)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        do = tl.load(do_ptr + tok_v, mask=in_t[:, None] & mv[None, :], other=0.0)
        delta = tl.load(vnew_ptr + (row0 + rows)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        v = tl.load(v_ptr + tok_v, mask=in_t[:, None] & mv[None, :], other=0.0).to(tl.float32)
        dM += mm(do, tl.trans(delta), DOT)
        dXu = mm(tl.trans(Y), d_delta, DOT)  # U = Y Xu, Xu = beta v
        tl.store(dv_ptr + tok_v, (beta[:, None] * dXu).to(dv_ptr.dtype.element_ty), mask=in_t[:, None] & mv[None, :])
        dbeta += tl.sum(dXu * v, axis=1)
        dY += mm(d_delta, tl.trans(beta[:, None] * v), DOT)
    tl.store(dM_ptr + (row0 + rows)[:, None] * BT + rows[None, :], tl.where(rows[:, None] >= rows[None, :], dM, 0.0))
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        dW = tl.zeros([BT, BK], dtype=tl.float32)
        dQg = tl.zeros([BT, BK], dtype=tl.float32)
        dKd = tl.zeros([BT, BK], dtype=tl.float32)
        d_decay = tl.zeros([BK], dtype=tl.float32)
        for vb in range(0, tl.cdiv(V, BV)):
            cv = vb * BV + tl.arange(0, BV)
            mv = cv < V
            at = ((bh * NT + c) * K + ck)[:, None] * V + cv[None, :]
            S0 = tl.load(h_ptr + at, mask=mk[:, None] & mv[None, :], other=0.0)
            dS = tl.load(dh_ptr + at, mask=mk[:, None] & mv[None, :], other=0.0)
            d_delta = tl.load(ddelta_ptr + (row0 + rows)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
            do = tl.load(do_ptr + token_rows(b, h, t, T, H)[:, None] * V + cv[None, :],
                         mask=in_t[:, None] & mv[None, :], other=0.0)
            delta = tl.load(vnew_ptr + (row0 + rows)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
            dW -= mm(d_delta, tl.trans(S0), DOT)
            dQg += mm(do, tl.trans(S0), DOT)
            dKd += mm(delta, tl.trans(dS), DOT)
            d_decay += tl.sum(S0.to(tl.float32) * dS.to(tl.float32), axis=1)
        at_k = (row0 + rows)[:, None] * K + ck[None, :]
        tl.store(dW_ptr + at_k, dW, mask=mk[None, :])
        tl.store(dQg_ptr + at_k, dQg, mask=mk[None, :])
        tl.store(dKd_ptr + at_k, dKd, mask=mk[None, :])
        tl.store(ddecay_ptr + (bh * NT + c) * K + ck, d_decay, mask=mk)
        k = tl.load(k_ptr + token_rows(b, h, t, T, H)[:, None] * K + ck[None, :],
                    mask=in_t[:, None] & mk[None, :], other=0.0).to(tl.float32)
        G = tl.load(G_ptr + at_k, mask=mk[None, :], other=0.0)
        dY += mm(dW, tl.trans(beta[:, None] * decay_le1(G) * k), DOT)  # W = Y Xw
    # Y = (I + A)^{-1}: dA = -(Y^T dY Y^T), strictly lower; A = diag(beta) P.
    Yt = tl.trans(Y)
    dA = -tl.dot(tl.dot(Yt.to(tl.float32), dY, input_precision="ieee"), Yt.to(tl.float32), input_precision="ieee")
    dA = tl.where(rows[:, None] > rows[None, :], dA, 0.0)
    P = tl.load(P_ptr + (row0 + rows)[:, None] * BT + rows[None, :])
    dbeta += tl.sum(dA * P, axis=1)
    tl.store(dA_ptr + (row0 + rows)[:, None] * BT + rows[None, :], dA)
    tl.store(dbeta_ptr + row0 + rows, dbeta)


@triton.jit
def _intra_bwd_kernel(q_ptr, k_ptr, beta_ptr, G_ptr, Y_ptr, dM_ptr, dA_ptr, dW_ptr, dQg_ptr, dKd_ptr, ddecay_ptr,
                      dq_ptr, dk_ptr, dg_ptr, dbeta_ptr, T, H, scale,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                      DOT: tl.constexpr):
    """One (chunk, K block): dq, dk, dg, and the beta gradient through W ([NK, B*H, NT*BT]).
    dM and dP = diag(beta) dA are read from memory where used (masked blocks, single columns)
    rather than held, which keeps the registers for the [BT, BK] tiles."""
    c, bh, kb = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    NT = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows = tl.arange(0, BT)
    t = c * BT + rows
    in_t = t < T
    rb, ri = rows // BC, rows % BC
    cols = tl.arange(0, BT)
    cb = cols // BC
    row0 = bh * NT * BT + c * BT
    ck = kb * BK + tl.arange(0, BK)
    mk = ck < K
    tok = token_rows(b, h, t, T, H)[:, None] * K + ck[None, :]
    m_tok = in_t[:, None] & mk[None, :]
    at_k = (row0 + rows)[:, None] * K + ck[None, :]
    pair = (row0 + rows)[:, None] * BT + cols[None, :]  # [BT, BT] tiles of this chunk
    q = tl.load(q_ptr + tok, mask=m_tok, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + tok, mask=m_tok, other=0.0).to(tl.float32)
    G = tl.load(G_ptr + at_k, mask=mk[None, :], other=0.0)
    beta = tl.load(beta_ptr + token_rows(b, h, t, T, H), mask=in_t, other=0.0).to(tl.float32)

    # The pairwise M (q . k) and P (k . k), dP = diag(beta) dA. Row side: sum_j dM_ij e^{G_i - G_j} k_j
    # (dq) and the same with dP (dk); column side: sum_i (dM_ij q_i + dP_ij k_i) e^{G_i - G_j} (dk).
    dq_pair = tl.zeros([BT, BK], dtype=tl.float32)
    dk_row = tl.zeros([BT, BK], dtype=tl.float32)
    dk_col = tl.zeros([BT, BK], dtype=tl.float32)
    for a in tl.static_range(1, BT // BC):
        # rows of sub-chunk a against the columns before it: reference row n = 16a
        Gn = tl.load(G_ptr + (row0 + a * BC) * K + ck, mask=mk, other=0.0)
        kF = k * decay_le1(Gn[None, :] - G)
        E = decay_le1(G - Gn[None, :])
        block = (rb[:, None] == a) & (cb[None, :] < a)
        dM_blk = tl.load(dM_ptr + pair, mask=block, other=0.0)
        dP_blk = beta[:, None] * tl.load(dA_ptr + pair, mask=block, other=0.0)
        dq_pair += mm(dM_blk, kF, DOT) * E
        dk_row += mm(dP_blk, kF, DOT) * E
        # the columns of sub-chunk a - 1 against the rows after them: reference row m = 16a - 1
        Gm = tl.load(G_ptr + (row0 + a * BC - 1) * K + ck, mask=mk, other=0.0)
        Em = decay_le1(G - Gm[None, :])
        below = (rb[:, None] >= a) & (cb[None, :] == a - 1)
        dM_blk = tl.load(dM_ptr + pair, mask=below, other=0.0)
        dP_blk = beta[:, None] * tl.load(dA_ptr + pair, mask=below, other=0.0)
        dk_col += (mm(tl.trans(dM_blk), q * Em, DOT) + mm(tl.trans(dP_blk), k * Em, DOT)) * decay_le1(Gm[None, :] - G)
    # The 16 x 16 diagonal blocks, exactly, one column jl of every sub-chunk at a time (j < i).
    for jl in range(0, BC):
        j = rb * BC + jl
        tj = c * BT + j
        kj = tl.load(k_ptr + token_rows(b, h, tj, T, H)[:, None] * K + ck[None, :],
                     mask=(tj < T)[:, None] & mk[None, :], other=0.0).to(tl.float32)
        Gj = tl.load(G_ptr + (row0 + j)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        E = tl.exp(tl.where(ri[:, None] > jl, G - Gj, float("-inf")).to(tl.float32))
        dMj = tl.load(dM_ptr + (row0 + rows) * BT + j)  # dM[i, j_i]
        dPj = beta * tl.load(dA_ptr + (row0 + rows) * BT + j)
        dq_pair += dMj[:, None] * kj * E
        dk_row += dPj[:, None] * kj * E
        to_j = (dMj[:, None] * q + dPj[:, None] * k) * E  # row i's part of dk_j
        per_block = tl.sum(tl.reshape(to_j, [BT // BC, BC, BK]), axis=1)  # [sub-chunks, BK]
        spread = tl.reshape(tl.broadcast_to(per_block[:, None, :], [BT // BC, BC, BK]), [BT, BK])
        dk_col += tl.where(ri[:, None] == jl, spread, 0.0)
    # dG_i = q_i dq_i - k_i dk_i over the off-diagonal terms; the diagonal of M (q_i . k_i) has no decay.
    dG = q * dq_pair + k * (dk_row - dk_col)
    dM_diag = tl.load(dM_ptr + (row0 + rows) * BT + rows)
    dq = dq_pair + dM_diag[:, None] * k
    dk = dk_row + dk_col + dM_diag[:, None] * q

    # Through W = Y Xw (Xw = beta e^G k), Qg = e^G q, Kd = e^{G_last - G} k and e^{G_last}.
    eG = decay_le1(G)
    Y = tl.load(Y_ptr + pair)
    dXw = mm(tl.trans(Y), tl.load(dW_ptr + at_k, mask=mk[None, :], other=0.0), DOT)
    tl.store(dbeta_ptr + (kb * tl.num_programs(1) + bh) * NT * BT + c * BT + rows, tl.sum(dXw * eG * k, axis=1))
    dk += dXw * beta[:, None] * eG
    dG += dXw * beta[:, None] * eG * k
    dQg = tl.load(dQg_ptr + at_k, mask=mk[None, :], other=0.0)
    dq += dQg * eG
    dG += dQg * q * eG
    G_last = tl.load(G_ptr + (row0 + BT - 1) * K + ck, mask=mk, other=0.0)
    Kd_decay = decay_le1(G_last[None, :] - G)
    dKd = tl.load(dKd_ptr + at_k, mask=mk[None, :], other=0.0)
    dk += dKd * Kd_decay
    # Kd_i depends on g_m for i < m: dg_m gets sum_{i<m} dKd_i Kd_i, summed from the rows shifted
    # by one (reloaded) rather than as cumsum - self, which would cancel an O(1) last row against
    # itself and lose the e^{-large} rest; e^{G_last} depends on every g of the chunk.
    prev = rows - 1
    m_prev = (prev >= 0)[:, None] & mk[None, :]
    k_prev = tl.load(k_ptr + token_rows(b, h, c * BT + prev, T, H)[:, None] * K + ck[None, :],
                     mask=m_prev & (c * BT + prev < T)[:, None], other=0.0).to(tl.float32)
    G_prev = tl.load(G_ptr + (row0 + prev)[:, None] * K + ck[None, :], mask=m_prev, other=0.0)
    dKd_prev = tl.load(dKd_ptr + (row0 + prev)[:, None] * K + ck[None, :], mask=m_prev, other=0.0)
    KdKd_prev = dKd_prev * k_prev * decay_le1(G_last[None, :] - G_prev)
    d_decay = tl.load(ddecay_ptr + (bh * NT + c) * K + ck, mask=mk, other=0.0)
    dg = (tl.cumsum(dG, axis=0, reverse=True) + tl.cumsum(KdKd_prev, axis=0)
          + (d_decay * decay_le1(G_last))[None, :])
    tl.store(dq_ptr + tok, dq * scale, mask=m_tok)
    tl.store(dk_ptr + tok, dk, mask=m_tok)
    tl.store(dg_ptr + tok, dg, mask=m_tok)
