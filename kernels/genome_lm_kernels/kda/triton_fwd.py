"""Kimi Delta Attention forward in Triton: the chunk-parallel kernels and the state pass.

The math is ``chunked.py``'s (read its docstring first). Per chunk of BT = 64 tokens, with G the
in-chunk cumulative log-decay (per channel), q already scaled:

    M_ij = q_i . e^{G_i - G_j} k_j   (j <= i)        P_ij = k_i . e^{G_i - G_j} k_j   (j < i)
    Y = (I + diag(beta) P)^{-1}                          W = Y (beta e^G k),  U = Y (beta v)
    delta = U - W S0,   o = (e^G q) S0 + M delta,   S_end = e^{G_last} S0 + (e^{G_last - G} k)^T delta

Five kernels, each small enough to read in one sitting:
  ``_cumsum_kernel``     G, per chunk (fp32; fp64 in the exact mode, so differences of long sums
                         keep their digits);
  ``_intra_kernel``      M and P with tensor-core products on 16-row sub-chunks: the rows of
                         sub-chunk a against the columns left of it share the reference row
                         n = 16a, e^{G_i - G_j} = e^{G_i - G_n} e^{G_n - G_j}, both factors <= 1
                         for any decay; the 16 x 16 diagonal blocks exactly, 16 columns at a time;
  ``_solve_kernel``      Y block by block (each 16 x 16 diagonal block inverted by forward
                         substitution, the blocks below it by products), then W and U, and
                         e^G q, e^{G_last - G} k, e^{G_last} for the state passes;
  ``_state_kernel``      the only sequential part: one program per (batch*head, block of V)
                         carries its [K, BV] fp32 state through the chunks;
  ``_output_kernel``     o, all chunks in parallel, from the states the state pass stored.

Precision (``DOT``): "bf16" and "fp16" give the matrix products half-precision operands with
fp32 accumulation (tensor cores); decays, G, the triangular solve and the recurrent state stay
fp32. "ieee" makes every product fp32 with ``input_precision="ieee"`` (the exact mode, for parity
tests). "bf16-emulated" rounds the operands to bf16 and multiplies them exactly in fp32, which is
the same arithmetic: Triton's interpreter multiplies bf16 operands wrongly (it reads their bits
as integers), so the CPU tests of the bf16 mode run this way. The interpreter also converts fp32
to bf16 by truncation where a GPU rounds to nearest even (``tl.float32 -> tl.bfloat16`` is
``fptrunc``, round-to-nearest-even on the device), and truncation's one-sided errors add up
along sums (measured: 3-4x the RMS error of rounding): the emulated mode rounds to nearest even
itself (``round_bf16``), before its products and before every store into a bf16 buffer
(``to_buffer``). fp16 needs no emulation: the interpreter multiplies fp16 operands correctly
(numpy's matmul with an fp32 result type) and converts to fp16 with numpy, to nearest.
The chunk buffers' dtype is the caller's (each store converts to the buffer's element type).
Per-token inputs are [B, T, H, X] (contiguous); chunk buffers are heads-first and padded to whole
chunks, [B*H, NT*BT, X], so only per-token loads and stores need a mask. Padded rows hold
q = k = v = beta = 0 and G constant, which leaves the state untouched.
"""

from __future__ import annotations

import triton
import triton.language as tl

from genome_lm_kernels.interpreter import share_language_patches

share_language_patches()  # under Triton's interpreter only


@triton.jit
def round_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32: the GPU's conversion,
    written out for the interpreter, whose own conversion truncates (x finite)."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def to_buffer(x, ptr, DOT: tl.constexpr):
    """x converted to the element type of the chunk buffer at ``ptr``, rounded to nearest (the
    emulated bf16 mode rounds first, so that the interpreter's truncating conversion is exact)."""
    if DOT == "bf16-emulated":
        x = round_bf16(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def mm(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 or fp16 operands (tensor cores) or exact fp32 (see ``DOT``)."""
    if DOT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    elif DOT == "bf16-emulated":
        return tl.dot(round_bf16(a), round_bf16(b), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def decay_le1(x):
    """e^x for an exponent that is <= 0 wherever the result is used; the clamp keeps the
    entries that a mask drops afterwards finite (never inf * 0)."""
    return tl.exp(tl.minimum(x.to(tl.float32), 0.0))


@triton.jit
def token_rows(b, h, t, T, H):
    """Row index of (batch b, token t, head h) in a contiguous [B, T, H, X] tensor (int64)."""
    return (b * T + t) * H + h


@triton.jit
def _cumsum_kernel(g_ptr, G_ptr, T, H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """G [B*H, NT*BT, K] = the cumulative sum of g over each chunk (rows past T repeat the last)."""
    c, bh, kb = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    NT = tl.num_programs(0)
    b, h = bh // H, bh % H
    t = c * BT + tl.arange(0, BT)
    ck = kb * BK + tl.arange(0, BK)
    mk = ck < K
    g = tl.load(g_ptr + token_rows(b, h, t, T, H)[:, None] * K + ck[None, :],
                mask=(t < T)[:, None] & mk[None, :], other=0.0)
    G = tl.cumsum(g.to(G_ptr.dtype.element_ty), axis=0)
    tl.store(G_ptr + (bh * NT * BT + t)[:, None] * K + ck[None, :], G, mask=mk[None, :])


@triton.jit
def _intra_kernel(q_ptr, k_ptr, G_ptr, M_ptr, P_ptr, T, H, scale,
                  K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                  DOT: tl.constexpr):
    """M [B*H, NT*BT, BT] (lower, with the diagonal) and P (strictly lower), one chunk a program."""
    c, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NT = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows = tl.arange(0, BT)
    t = c * BT + rows
    rb, ri = rows // BC, rows % BC  # sub-chunk of a row, and the row inside it
    cols = tl.arange(0, BT)
    cb = cols // BC
    row0 = bh * NT * BT + c * BT  # this chunk's first row in the padded buffers
    Macc = tl.zeros([BT, BT], dtype=tl.float32)
    Pacc = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        m_in = (t < T)[:, None] & mk[None, :]
        q = tl.load(q_ptr + token_rows(b, h, t, T, H)[:, None] * K + ck[None, :], mask=m_in, other=0.0)
        q = q.to(tl.float32) * scale
        k = tl.load(k_ptr + token_rows(b, h, t, T, H)[:, None] * K + ck[None, :], mask=m_in, other=0.0)
        k = k.to(tl.float32)
        G = tl.load(G_ptr + (row0 + rows)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        # Blocks left of the diagonal: sub-chunk a's rows against every column before 16a.
        for a in tl.static_range(1, BT // BC):
            Gn = tl.load(G_ptr + (row0 + a * BC) * K + ck, mask=mk, other=0.0)
            E = decay_le1(G - Gn[None, :])  # e^{G_i - G_n}, i in sub-chunk a
            kF = k * decay_le1(Gn[None, :] - G)  # e^{G_n - G_j} k_j, j before sub-chunk a
            in_a = (rb == a)[:, None]
            block = (rb[:, None] == a) & (cb[None, :] < a)
            Macc += tl.where(block, mm(tl.where(in_a, q * E, 0.0), tl.trans(kF), DOT), 0.0)
            Pacc += tl.where(block, mm(tl.where(in_a, k * E, 0.0), tl.trans(kF), DOT), 0.0)
        # The 16 x 16 diagonal blocks, exactly: column j = 16 * (sub-chunk) + jl of every row.
        for jl in range(0, BC):
            j = rb * BC + jl
            tj = c * BT + j
            kj = tl.load(k_ptr + token_rows(b, h, tj, T, H)[:, None] * K + ck[None, :],
                         mask=(tj < T)[:, None] & mk[None, :], other=0.0).to(tl.float32)
            Gj = tl.load(G_ptr + (row0 + j)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
            kjE = kj * tl.exp(tl.where(ri[:, None] >= jl, G - Gj, float("-inf")).to(tl.float32))
            at_j = cols[None, :] == j[:, None]
            Macc += tl.where(at_j, tl.sum(q * kjE, axis=1)[:, None], 0.0)
            Pacc += tl.where(at_j & (ri[:, None] > jl), tl.sum(k * kjE, axis=1)[:, None], 0.0)
    out = (row0 + rows)[:, None] * BT + cols[None, :]
    tl.store(M_ptr + out, to_buffer(Macc, M_ptr, DOT))
    tl.store(P_ptr + out, Pacc)


@triton.jit
def unit_lower_inverse(A, BC: tl.constexpr):
    """(I + A)^{-1} of a strictly lower [BC, BC] tile by forward substitution, in fp32."""
    r = tl.arange(0, BC)
    Y = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BC):
        a_i = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)  # row i of A
        y_i = tl.where(r == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Y, axis=0)
        Y = tl.where(r[:, None] == i, y_i[None, :], Y)
    return Y


@triton.jit
def _beta_p_block(P_ptr, beta_ptr, b, h, c, row0, a, jb, T, H, BT: tl.constexpr, BC: tl.constexpr):
    """Block (a, jb) of A = diag(beta) P, [BC, BC] fp32."""
    r = tl.arange(0, BC)
    t = c * BT + a * BC + r
    beta = tl.load(beta_ptr + token_rows(b, h, t, T, H), mask=t < T, other=0.0).to(tl.float32)
    P = tl.load(P_ptr + (row0 + a * BC + r)[:, None] * BT + jb * BC + r[None, :])
    return beta[:, None] * P


@triton.jit
def _solve_rows(P_ptr, beta_ptr, b, h, c, row0, a, R, T, H, BT: tl.constexpr, BC: tl.constexpr):
    """Rows of sub-chunk a of Y: (I + A_aa)^{-1} R, where R = E_a - sum_{jb<a} A_a,jb Y_jb."""
    Dinv = unit_lower_inverse(_beta_p_block(P_ptr, beta_ptr, b, h, c, row0, a, a, T, H, BT, BC), BC)
    return tl.dot(Dinv, R, input_precision="ieee")


@triton.jit
def _identity_rows(a, BT: tl.constexpr, BC: tl.constexpr):
    r, cols = tl.arange(0, BC), tl.arange(0, BT)
    return tl.where(cols[None, :] == (a * BC + r)[:, None], 1.0, 0.0)


@triton.jit
def _store_rows(out_ptr, Ya, a, X, row0, cols, m_cols, D, BC: tl.constexpr, DOT: tl.constexpr):
    """Rows of sub-chunk a of Y @ X into out [.., D] at columns ``cols``."""
    r = tl.arange(0, BC)
    tl.store(out_ptr + (row0 + a * BC + r)[:, None] * D + cols[None, :],
             to_buffer(mm(Ya, X, DOT), out_ptr, DOT), mask=m_cols[None, :])


@triton.jit
def _solve_kernel(P_ptr, beta_ptr, q_ptr, k_ptr, v_ptr, G_ptr, Y_ptr, W_ptr, U_ptr, Qg_ptr, Kd_ptr, decay_ptr,
                  T, H, scale, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """Y = (I + diag(beta) P)^{-1} by 16-row blocks (fp32), then W = Y (beta e^G k), U = Y (beta v),
    and what the state passes read instead of G: Qg = e^G q, Kd = e^{G_last - G} k, e^{G_last}."""
    c, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NT = tl.num_programs(0)
    b, h = bh // H, bh % H
    row0 = bh * NT * BT + c * BT
    Y0 = _solve_rows(P_ptr, beta_ptr, b, h, c, row0, 0, _identity_rows(0, BT, BC), T, H, BT, BC)
    R1 = _identity_rows(1, BT, BC) - tl.dot(_beta_p_block(P_ptr, beta_ptr, b, h, c, row0, 1, 0, T, H, BT, BC), Y0,
                                            input_precision="ieee")
    Y1 = _solve_rows(P_ptr, beta_ptr, b, h, c, row0, 1, R1, T, H, BT, BC)
    R2 = (_identity_rows(2, BT, BC)
          - tl.dot(_beta_p_block(P_ptr, beta_ptr, b, h, c, row0, 2, 0, T, H, BT, BC), Y0, input_precision="ieee")
          - tl.dot(_beta_p_block(P_ptr, beta_ptr, b, h, c, row0, 2, 1, T, H, BT, BC), Y1, input_precision="ieee"))
    Y2 = _solve_rows(P_ptr, beta_ptr, b, h, c, row0, 2, R2, T, H, BT, BC)
    R3 = (_identity_rows(3, BT, BC)
          - tl.dot(_beta_p_block(P_ptr, beta_ptr, b, h, c, row0, 3, 0, T, H, BT, BC), Y0, input_precision="ieee")
          - tl.dot(_beta_p_block(P_ptr, beta_ptr, b, h, c, row0, 3, 1, T, H, BT, BC), Y1, input_precision="ieee")
          - tl.dot(_beta_p_block(P_ptr, beta_ptr, b, h, c, row0, 3, 2, T, H, BT, BC), Y2, input_precision="ieee"))
    Y3 = _solve_rows(P_ptr, beta_ptr, b, h, c, row0, 3, R3, T, H, BT, BC)

    r, cols = tl.arange(0, BC), tl.arange(0, BT)
    tl.store(Y_ptr + (row0 + 0 * BC + r)[:, None] * BT + cols[None, :], to_buffer(Y0, Y_ptr, DOT))
    tl.store(Y_ptr + (row0 + 1 * BC + r)[:, None] * BT + cols[None, :], to_buffer(Y1, Y_ptr, DOT))
    tl.store(Y_ptr + (row0 + 2 * BC + r)[:, None] * BT + cols[None, :], to_buffer(Y2, Y_ptr, DOT))
    tl.store(Y_ptr + (row0 + 3 * BC + r)[:, None] * BT + cols[None, :], to_buffer(Y3, Y_ptr, DOT))

    rows = tl.arange(0, BT)
    t = c * BT + rows
    beta = tl.load(beta_ptr + token_rows(b, h, t, T, H), mask=t < T, other=0.0).to(tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        m_tok = (t < T)[:, None] & mk[None, :]
        k = tl.load(k_ptr + token_rows(b, h, t, T, H)[:, None] * K + ck[None, :], mask=m_tok, other=0.0)
        k = k.to(tl.float32)
        q = tl.load(q_ptr + token_rows(b, h, t, T, H)[:, None] * K + ck[None, :], mask=m_tok, other=0.0)
        G = tl.load(G_ptr + (row0 + rows)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        G_last = tl.load(G_ptr + (row0 + BT - 1) * K + ck, mask=mk, other=0.0)
        eG = decay_le1(G)
        at_k = (row0 + rows)[:, None] * K + ck[None, :]
        tl.store(Qg_ptr + at_k, to_buffer(q.to(tl.float32) * scale * eG, Qg_ptr, DOT), mask=mk[None, :])
        tl.store(Kd_ptr + at_k, to_buffer(k * decay_le1(G_last[None, :] - G), Kd_ptr, DOT), mask=mk[None, :])
        tl.store(decay_ptr + (bh * NT + c) * K + ck, decay_le1(G_last), mask=mk)
        Xw = beta[:, None] * eG * k
        _store_rows(W_ptr, Y0, 0, Xw, row0, ck, mk, K, BC, DOT)
        _store_rows(W_ptr, Y1, 1, Xw, row0, ck, mk, K, BC, DOT)
        _store_rows(W_ptr, Y2, 2, Xw, row0, ck, mk, K, BC, DOT)
        _store_rows(W_ptr, Y3, 3, Xw, row0, ck, mk, K, BC, DOT)
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        mv = cv < V
        v = tl.load(v_ptr + token_rows(b, h, t, T, H)[:, None] * V + cv[None, :],
                    mask=(t < T)[:, None] & mv[None, :], other=0.0).to(tl.float32)
        Xu = beta[:, None] * v
        _store_rows(U_ptr, Y0, 0, Xu, row0, cv, mv, V, BC, DOT)
        _store_rows(U_ptr, Y1, 1, Xu, row0, cv, mv, V, BC, DOT)
        _store_rows(U_ptr, Y2, 2, Xu, row0, cv, mv, V, BC, DOT)
        _store_rows(U_ptr, Y3, 3, Xu, row0, cv, mv, V, BC, DOT)


@triton.jit
def _state_kernel(W_ptr, U_ptr, Kd_ptr, decay_ptr, s0_ptr, h_ptr, vnew_ptr, sT_ptr, NT,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  HAS_S0: tl.constexpr, STORE_H: tl.constexpr, DOT: tl.constexpr):
    """The recurrence over chunks for one (batch*head, V block): state [K, BV] in fp32 registers.
    Writes delta = U - W S0 of every chunk (vnew), the final state, and with STORE_H the state
    entering every chunk, h [B*H, NT, K, V]. K is one block (BK >= K)."""
    vb, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BT)
    ck, cv = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    state = (bh * K + ck)[:, None] * V + cv[None, :]
    m_state = mk[:, None] & mv[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + state, mask=m_state, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(0, NT):
        row0 = bh * NT * BT + c * BT
        if STORE_H:
            tl.store(h_ptr + ((bh * NT + c) * K + ck)[:, None] * V + cv[None, :], to_buffer(S, h_ptr, DOT),
                     mask=m_state)
        W = tl.load(W_ptr + (row0 + rows)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        U = tl.load(U_ptr + (row0 + rows)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        delta = U.to(tl.float32) - mm(W, S, DOT)
        tl.store(vnew_ptr + (row0 + rows)[:, None] * V + cv[None, :], to_buffer(delta, vnew_ptr, DOT),
                 mask=mv[None, :])
        Kd = tl.load(Kd_ptr + (row0 + rows)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        decay = tl.load(decay_ptr + (bh * NT + c) * K + ck, mask=mk, other=0.0)
        S = decay[:, None] * S + mm(tl.trans(Kd), delta, DOT)
    tl.store(sT_ptr + state, S, mask=m_state)


@triton.jit
def _output_kernel(Qg_ptr, M_ptr, h_ptr, vnew_ptr, o_ptr, T, H,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   DOT: tl.constexpr):
    """o = (e^G q) S0 + M delta for one (chunk, batch*head, V block)."""
    c, bh, vb = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    NT = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows = tl.arange(0, BT)
    t = c * BT + rows
    row0 = bh * NT * BT + c * BT
    cv = vb * BV + tl.arange(0, BV)
    mv = cv < V
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        Qg = tl.load(Qg_ptr + (row0 + rows)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        S0 = tl.load(h_ptr + ((bh * NT + c) * K + ck)[:, None] * V + cv[None, :],
                     mask=mk[:, None] & mv[None, :], other=0.0)
        acc += mm(Qg, S0, DOT)
    M = tl.load(M_ptr + (row0 + rows)[:, None] * BT + rows[None, :])
    delta = tl.load(vnew_ptr + (row0 + rows)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
    acc += mm(M, delta, DOT)
    tl.store(o_ptr + token_rows(b, h, t, T, H)[:, None] * V + cv[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & mv[None, :])
