"""Kimi Delta Attention, chunked forward in Triton (the GPU path); the same math as ``chunked.py``.

Two kernels, fp32 throughout:
  1. ``_chunk_prepare_kernel``, one program per (chunk, batch*head): in-chunk cumulative decay G,
     the pairwise A (k.k) and M (q.k) with exact per-channel e^{G_i - G_j}, one column at a time,
     (I + A)^{-1} by forward substitution, then W, U, e^G q, e^{G_last - G} k, e^{G_last}.
  2. ``_chunk_state_kernel``, one program per (batch*head): walks the chunks in order with the
     [K, V] state in registers, writes o and the final state.
Tails need no padding copies: rows past T load as zeros (g = 0, beta = 0, k = 0 leave the state
unchanged) and their outputs are dropped.

Backward: NOT in Triton yet. ``kda_triton`` is an autograd.Function whose backward recomputes
the forward through the torch chunked path and differentiates that (correct, CPU-speed).
Known GPU cost left on the table: kernel 1 builds A and M column by column instead of with
tl.dot on sub-chunk blocks (see chunked.py for the factorisation), and K, V are one block each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunked import kda_chunked

CHUNK = 64


@triton.jit
def _row(x, rows, i):
    """Row i of a register tile x [R, C] as a [C] vector."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), axis=0)


@triton.jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # [BH, T, K] x3 (q pre-scaled), [BH, T, V], [BH, T]
    w_ptr, u_ptr, m_ptr, qg_ptr, kd_ptr, decay_ptr,  # [BH, NT*64, K|V|64], decay [BH, NT, K]
    T, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    c, bh = tl.program_id(0), tl.program_id(1)
    NT = tl.num_programs(0)
    rows = tl.arange(0, BT)
    cols_t = tl.arange(0, BT)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    t = c * BT + rows
    in_t = t < T
    mk = in_t[:, None] & (ck[None, :] < K)
    mv = in_t[:, None] & (cv[None, :] < V)
    q = tl.load(q_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=mk, other=0.0)
    k = tl.load(k_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=mk, other=0.0)
    g = tl.load(g_ptr + bh * T * K + t[:, None] * K + ck[None, :], mask=mk, other=0.0)
    v = tl.load(v_ptr + bh * T * V + t[:, None] * V + cv[None, :], mask=mv, other=0.0)
    beta = tl.load(beta_ptr + bh * T + t, mask=in_t, other=0.0)
    G = tl.cumsum(g, axis=0)

    # A_ij = k_i . e^{G_i - G_j} k_j and M_ij = q_i . e^{G_i - G_j} k_j for j <= i, column j at a time.
    A = tl.zeros([BT, BT], dtype=tl.float32)
    M = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(BT):
        k_j = _row(k, rows, j)
        G_j = _row(G, rows, j)
        expo = tl.where(rows[:, None] >= j, G - G_j[None, :], float("-inf"))
        k_dec = k_j[None, :] * tl.exp(expo)  # [BT, BK], zero above the diagonal
        A = tl.where(cols_t[None, :] == j, tl.sum(k * k_dec, axis=1)[:, None], A)
        M = tl.where(cols_t[None, :] == j, tl.sum(q * k_dec, axis=1)[:, None], M)
    A = tl.where(rows[:, None] > cols_t[None, :], A * beta[:, None], 0.0)

    # Y = (I + A)^{-1}: row i = e_i - sum_{j<i} A_ij Y_j (rows j < i are final).
    Y = tl.where(rows[:, None] == cols_t[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_i = _row(A, rows, i)
        y_i = tl.where(cols_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Y, axis=0)
        Y = tl.where(rows[:, None] == i, y_i[None, :], Y)

    eG = tl.exp(G)
    W = tl.dot(Y, beta[:, None] * eG * k, input_precision="ieee")
    U = tl.dot(Y, beta[:, None] * v, input_precision="ieee")
    G_last = _row(G, rows, BT - 1)

    r = bh * NT * BT + c * BT + rows  # row in the [BH, NT*64, .] buffers (all rows written)
    all_k = ck[None, :] < K
    tl.store(w_ptr + r[:, None] * K + ck[None, :], W, mask=all_k)
    tl.store(qg_ptr + r[:, None] * K + ck[None, :], q * eG, mask=all_k)
    tl.store(kd_ptr + r[:, None] * K + ck[None, :], k * tl.exp(G_last[None, :] - G), mask=all_k)
    tl.store(u_ptr + r[:, None] * V + cv[None, :], U, mask=cv[None, :] < V)
    tl.store(m_ptr + r[:, None] * BT + cols_t[None, :], M)
    tl.store(decay_ptr + (bh * NT + c) * K + ck, tl.exp(G_last), mask=ck < K)


@triton.jit
def _chunk_state_kernel(
    w_ptr, u_ptr, m_ptr, qg_ptr, kd_ptr, decay_ptr,
    s0_ptr, o_ptr, s_ptr,  # [BH, K, V] initial state (if HAS_S0), o [BH, NT*64, V], final [BH, K, V]
    NT, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_S0: tl.constexpr,
):
    bh = tl.program_id(0)
    rows = tl.arange(0, BT)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    s_off = bh * K * V + ck[:, None] * V + cv[None, :]
    m_state = mk[:, None] & mv[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=m_state, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(NT):
        r = bh * NT * BT + c * BT + rows
        W = tl.load(w_ptr + r[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        Qg = tl.load(qg_ptr + r[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        Kd = tl.load(kd_ptr + r[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
        U = tl.load(u_ptr + r[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        M = tl.load(m_ptr + r[:, None] * BT + rows[None, :])
        decay = tl.load(decay_ptr + (bh * NT + c) * K + ck, mask=mk, other=0.0)
        delta = U - tl.dot(W, S, input_precision="ieee")  # [BT, BV]
        o = tl.dot(Qg, S, input_precision="ieee") + tl.dot(M, delta, input_precision="ieee")
        tl.store(o_ptr + r[:, None] * V + cv[None, :], o, mask=mv[None, :])
        S = decay[:, None] * S + tl.dot(tl.trans(Kd), delta, input_precision="ieee")
    tl.store(s_ptr + s_off, S, mask=m_state)


def _forward(q, k, v, g, beta, scale, initial_state):
    """Runs the two kernels. Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK)

    def heads_first(x):  # [B, T, H, ...] -> contiguous fp32 [B*H, T, ...]
        return x.float().transpose(1, 2).reshape(B * H, T, *x.shape[3:]).contiguous()

    q_, k_, v_, g_, beta_ = (heads_first(x) for x in (q * scale, k, v, g, beta))
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    W, Qg, Kd = (q_.new_empty(B * H, NT * CHUNK, K) for _ in range(3))
    U = q_.new_empty(B * H, NT * CHUNK, V)
    M = q_.new_empty(B * H, NT * CHUNK, CHUNK)
    decay = q_.new_empty(B * H, NT, K)
    _chunk_prepare_kernel[(NT, B * H)](
        q_, k_, v_, g_, beta_, W, U, M, Qg, Kd, decay, T, K=K, V=V, BT=CHUNK, BK=BK, BV=BV
    )
    o = q_.new_empty(B * H, NT * CHUNK, V)
    S = q_.new_empty(B, H, K, V)
    s0 = S if initial_state is None else initial_state.float().contiguous()
    _chunk_state_kernel[(B * H,)](
        W, U, M, Qg, Kd, decay, s0, o, S, NT,
        K=K, V=V, BT=CHUNK, BK=BK, BV=BV, HAS_S0=initial_state is not None,
    )
    return o[:, :T].reshape(B, H, T, V).transpose(1, 2), S


class _KDATriton(torch.autograd.Function):
    """Forward in Triton; backward by recomputing through the torch chunked path."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state):
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        return _forward(q, k, v, g, beta, scale, initial_state)

    @staticmethod
    def backward(ctx, do, dS):
        q, k, v, g, beta, s0 = ctx.saved_tensors
        inputs = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, g, beta, s0)]
        with torch.enable_grad():
            o, S = kda_chunked(*inputs[:5], ctx.scale, inputs[5])
            wanted = [x for x in inputs if x is not None]
            grads = iter(torch.autograd.grad((o, S), wanted, (do, dS), allow_unused=True))
        dq, dk, dv, dg, dbeta, ds0 = (next(grads) if x is not None else None for x in inputs)
        return dq, dk, dv, dg, dbeta, None, ds0


def kda_triton(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float,
    initial_state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kda_reference``: (o [B, T, H, V] fp32, final state [B, H, K, V] fp32)."""
    return _KDATriton.apply(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV)
