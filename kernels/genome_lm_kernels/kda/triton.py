"""Kimi Delta Attention on the GPU: launches the tiled Triton kernels of ``triton_fwd.py`` and
``triton_bwd.py`` and wraps them in an autograd Function.

Three precisions, one set of kernels:
  ``exact=False`` (backend "triton"): matrix products on tensor cores with half-precision operands
      and fp32 accumulation; the chunk buffers (M, Y, W, U, Qg, Kd, states, deltas and their
      gradients) are stored in that half type; decays, the cumulative decay G, the triangular
      solve and the recurrent state stay fp32. The half type is ``half``: bf16 by default, fp16
      for fp16 models (as fla-core does: its products and buffers follow the inputs' dtype; fp16
      keeps 3 more mantissa bits than bf16, in a range that tops out at 65504).
  ``exact=True`` (backend "triton-fp32"): every product in fp32 (``input_precision="ieee"``), the
      buffers in fp32 and G in fp64, which the parity tests compare with the reference at 2e-5;
      ``half`` is ignored.

The forward saves only its inputs; the backward recomputes the chunk buffers (one pass of the
chunk-parallel kernels and the state pass) before its three kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from . import triton_bwd as bwd
from . import triton_fwd as fwd

BT = 64  # tokens per chunk
BC = 16  # rows per sub-chunk (the solve is written for BT = 4 * BC)
MAX_K = 256  # the state pass holds all of K in one block


@dataclass(frozen=True)
class Launch:
    """Block sizes and launch settings of one kernel."""

    BK: int = 64  # K block (the state passes take all of K: BK >= K)
    BV: int = 64  # V block
    warps: int = 4
    stages: int = 1


@dataclass(frozen=True)
class Tiles:
    """Launch settings per kernel, chosen with the compile check (``genome_lm_kernels.compile_check``)
    so that at K = V = 128 no kernel spills registers or exceeds Hopper's shared memory."""

    intra: Launch
    solve: Launch
    state: Launch
    output: Launch
    state_bwd: Launch
    dqkw: Launch
    intra_bwd: Launch


def tiles(K: int, V: int, exact: bool) -> Tiles:
    """Measured with the compile check at K = V = 128 for sm_90 and sm_100: with bf16 operands no
    kernel spills or exceeds the shared memory. fp32 products (``input_precision="ieee"``) run on
    CUDA cores and hold their operands in registers: the exact mode uses small blocks and no
    software pipelining, fits the shared memory, but its state passes (which must hold all of K)
    spill a few hundred bytes per thread: it is for parity checks, not speed."""
    if K > MAX_K:
        raise ValueError(f"the triton KDA kernels take head dims K <= {MAX_K}; got K = {K}")
    k_all = max(16, triton.next_power_of_2(K))
    v_all = max(16, triton.next_power_of_2(V))

    def launch(BK, BV, warps, stages=1):
        return Launch(BK=min(BK, k_all), BV=min(BV, v_all), warps=warps, stages=stages)

    if exact:
        return Tiles(intra=launch(16, 0, 8), solve=launch(32, 32, 4), state=Launch(k_all, min(16, v_all), 8),
                     output=launch(32, 32, 4), state_bwd=Launch(k_all, min(16, v_all), 8),
                     dqkw=launch(16, 16, 8), intra_bwd=launch(16, 0, 8))
    return Tiles(intra=launch(64, 0, 8), solve=launch(64, 64, 8), state=Launch(k_all, min(32, v_all), 4, 2),
                 output=launch(64, 64, 8, 2), state_bwd=Launch(k_all, min(32, v_all), 8, 2),
                 dqkw=launch(32, 64, 8), intra_bwd=launch(16, 0, 8))


HALF_TYPES = (torch.bfloat16, torch.float16)  # the half types of the fast mode


def _check_half(half: torch.dtype) -> torch.dtype:
    if half not in HALF_TYPES:
        raise ValueError(f"half must be torch.bfloat16 or torch.float16; got {half}")
    return half


def dot_mode(exact: bool, half: torch.dtype = torch.bfloat16) -> str:
    """The kernels' ``DOT`` setting: fp32 ("ieee") when exact, else ``half`` operands. bf16 is
    emulated in fp32 under Triton's interpreter, which multiplies bf16 wrongly; fp16 needs no
    emulation (the interpreter hands fp16 operands to numpy's matmul with an fp32 result type,
    which is exact products and fp32 sums; see ``triton_fwd``)."""
    if exact:
        return "ieee"
    if _check_half(half) == torch.float16:
        return "fp16"
    return "bf16-emulated" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"


def store_dtype(exact: bool, half: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype of the chunk buffers (M, Y, W, U, Qg, Kd, h, delta, dh, d_delta)."""
    return torch.float32 if exact else _check_half(half)


class ChunkBuffers:
    """The forward's chunk buffers, heads-first and padded to whole chunks: G, M, P, Y, W, U, the
    state entering each chunk (h), delta = U - W S0 of each chunk, and the final state. The
    buffers are fp32 when ``exact``, else ``half`` (bf16 or fp16); G and P stay fp32 (fp64 G
    when exact)."""

    def __init__(self, q, k, v, g, beta, scale: float, exact: bool, initial_state=None, *,
                 half: torch.dtype = torch.bfloat16):
        B, T, H, K = k.shape
        V = v.shape[-1]
        NT = triton.cdiv(T, BT)
        BH, TP = B * H, NT * BT
        dev = k.device
        store = store_dtype(exact, half)
        t = self.tiles = tiles(K, V, exact)
        self.shape, self.exact, self.dot = (B, T, H, K, V, NT), exact, dot_mode(exact, half)

        self.G = torch.empty(BH, TP, K, device=dev, dtype=torch.float64 if exact else torch.float32)
        fwd._cumsum_kernel[(NT, BH, triton.cdiv(K, t.intra.BK))](g, self.G, T, H, K=K, BT=BT, BK=t.intra.BK)
        self.M = torch.empty(BH, TP, BT, device=dev, dtype=store)
        self.P = torch.empty(BH, TP, BT, device=dev, dtype=torch.float32)
        fwd._intra_kernel[(NT, BH)](q, k, self.G, self.M, self.P, T, H, scale, K=K, BT=BT, BC=BC, BK=t.intra.BK,
                                    DOT=self.dot, num_warps=t.intra.warps, num_stages=t.intra.stages)
        self.Y = torch.empty(BH, TP, BT, device=dev, dtype=store)
        self.W = torch.empty(BH, TP, K, device=dev, dtype=store)
        self.U = torch.empty(BH, TP, V, device=dev, dtype=store)
        self.Qg = torch.empty(BH, TP, K, device=dev, dtype=store)
        self.Kd = torch.empty(BH, TP, K, device=dev, dtype=store)
        self.decay = torch.empty(BH, NT, K, device=dev, dtype=torch.float32)
        fwd._solve_kernel[(NT, BH)](self.P, beta, q, k, v, self.G, self.Y, self.W, self.U, self.Qg, self.Kd, self.decay,
                                    T, H, scale, K=K, V=V, BT=BT, BC=BC, BK=t.solve.BK, BV=t.solve.BV, DOT=self.dot,
                                    num_warps=t.solve.warps, num_stages=t.solve.stages)
        self.h = torch.empty(BH, NT, K, V, device=dev, dtype=store)
        self.delta = torch.empty(BH, TP, V, device=dev, dtype=store)
        self.final_state = torch.empty(B, H, K, V, device=dev, dtype=torch.float32)
        s0 = initial_state.float().contiguous() if initial_state is not None else self.final_state
        fwd._state_kernel[(triton.cdiv(V, t.state.BV), BH)](
            self.W, self.U, self.Kd, self.decay, s0, self.h, self.delta, self.final_state, NT, K=K, V=V, BT=BT,
            BK=t.state.BK, BV=t.state.BV, HAS_S0=initial_state is not None, STORE_H=True, DOT=self.dot,
            num_warps=t.state.warps, num_stages=t.state.stages,
        )


def _contiguous(*xs):
    return tuple(x.contiguous() if x is not None else None for x in xs)


def kda_forward(q, k, v, g, beta, scale: float, initial_state=None, *, exact: bool = False,
                half: torch.dtype = torch.bfloat16):
    """(o [B, T, H, V] fp32, final state [B, H, K, V] fp32); q, k, g [B, T, H, K], v [B, T, H, V],
    beta [B, T, H], any float dtype (read as fp32). ``half``: the fast mode's operand and buffer
    type (bf16 or fp16; ignored when ``exact``)."""
    q, k, v, g, beta = _contiguous(q, k, v, g, beta)
    buf = ChunkBuffers(q, k, v, g, beta, scale, exact, initial_state, half=half)
    B, T, H, K, V, NT = buf.shape
    t = buf.tiles.output
    o = torch.empty(B, T, H, V, device=q.device, dtype=torch.float32)
    fwd._output_kernel[(NT, B * H, triton.cdiv(V, t.BV))](
        buf.Qg, buf.M, buf.h, buf.delta, o, T, H, K=K, V=V, BT=BT, BK=t.BK, BV=t.BV,
        DOT=buf.dot, num_warps=t.warps, num_stages=t.stages,
    )
    return o, buf.final_state


def kda_backward(q, k, v, g, beta, scale: float, initial_state, do, dS_final, *, exact: bool = False,
                 half: torch.dtype = torch.bfloat16):
    """Gradients (dq, dk, dv, dg, dbeta in [B, T, H, .] fp32; d initial state [B, H, K, V] fp32 or
    None without one) of sum(o * do) + sum(S_final * dS_final). Each buffer is dropped as soon
    as no later kernel reads it (``backward_bytes_per_token`` counts the peak)."""
    q, k, v, g, beta, do = _contiguous(q, k, v, g, beta, do)
    buf = ChunkBuffers(q, k, v, g, beta, scale, exact, initial_state, half=half)
    B, T, H, K, V, NT = buf.shape
    tls = buf.tiles
    BH, TP, dev = B * H, NT * BT, q.device
    store = buf.M.dtype
    dsT = (dS_final.float().contiguous() if dS_final is not None
           else torch.zeros(B, H, K, V, device=dev, dtype=torch.float32))
    dh = torch.empty(BH, NT, K, V, device=dev, dtype=store)
    d_delta = torch.empty(BH, TP, V, device=dev, dtype=store)
    ds0 = torch.empty(B, H, K, V, device=dev, dtype=torch.float32)
    t = tls.state_bwd
    bwd._state_bwd_kernel[(triton.cdiv(V, t.BV), BH)](
        buf.Qg, buf.Kd, buf.decay, buf.W, buf.M, do, dsT, dh, d_delta, ds0, T, NT, H,
        K=K, V=V, BT=BT, BK=t.BK, BV=t.BV, DOT=buf.dot, num_warps=t.warps, num_stages=t.stages,
    )
    buf.Qg = buf.Kd = buf.W = buf.U = buf.M = buf.decay = None  # read by the state passes only
    dW, dQg, dKd = (torch.empty(BH, TP, K, device=dev, dtype=torch.float32) for _ in range(3))
    d_decay = torch.empty(BH, NT, K, device=dev, dtype=torch.float32)
    dM, dA = (torch.empty(BH, TP, BT, device=dev, dtype=torch.float32) for _ in range(2))
    dv = torch.empty(B, T, H, V, device=dev, dtype=torch.float32)
    dbeta_ua = torch.empty(BH, TP, device=dev, dtype=torch.float32)
    t = tls.dqkw
    bwd._dqkw_kernel[(NT, BH)](
        v, k, beta, buf.G, buf.Y, buf.P, buf.h, dh, buf.delta, d_delta, do,
        dW, dQg, dKd, d_decay, dM, dA, dv, dbeta_ua, T, H,
        K=K, V=V, BT=BT, BK=t.BK, BV=t.BV, DOT=buf.dot, num_warps=t.warps, num_stages=t.stages,
    )
    buf.P = buf.h = buf.delta = None
    del dh, d_delta
    t = tls.intra_bwd
    NK = triton.cdiv(K, t.BK)
    dq, dk, dg = (torch.empty(B, T, H, K, device=dev, dtype=torch.float32) for _ in range(3))
    dbeta_w = torch.empty(NK, BH, TP, device=dev, dtype=torch.float32)
    bwd._intra_bwd_kernel[(NT, BH, NK)](
        q, k, beta, buf.G, buf.Y, dM, dA, dW, dQg, dKd, d_decay, dq, dk, dg, dbeta_w, T, H, scale,
        K=K, BT=BT, BC=BC, BK=t.BK, DOT=buf.dot, num_warps=t.warps, num_stages=t.stages,
    )
    del buf, dM, dA, dW, dQg, dKd, d_decay
    dbeta = (dbeta_ua + dbeta_w.sum(0)).view(B, H, TP)[:, :, :T].transpose(1, 2)
    return dq, dk, dv, dg, dbeta, (ds0 if initial_state is not None else None)


def backward_bytes_per_token(K: int, V: int, exact: bool = False, half: torch.dtype = torch.bfloat16) -> float:
    """Bytes per (token, head) that ``kda_backward`` holds at its peak, the largest of its phases
    (each buffer is freed once no later kernel reads it); the memory planner reads this so that
    it follows the kernels. bf16 and fp16 buffers are both 2 bytes."""
    store = store_dtype(exact, half).itemsize
    G = (8 if exact else 4) * K
    states = K * V * store / BT  # one [K, V] state per chunk
    # G, M, Y, P, W Qg Kd, U, h, delta
    recomputed = G + 2 * BT * store + BT * 4 + (3 * K + V) * store + states + V * store
    state_pass = recomputed + states + V * store  # + dh, d_delta
    products = (G + BT * store + BT * 4 + states + V * store + states + V * store  # G, Y, P, h, delta, dh, d_delta
                + 3 * K * 4 + K * 4 / BT + 2 * BT * 4 + V * 4 + 4)  # dW dQg dKd, d(e^G_last), dM dA, dv, dbeta
    last = (G + BT * store + 3 * K * 4 + K * 4 / BT + 2 * BT * 4 + V * 4 + 4  # G, Y, their inputs, dv, dbeta
            + 3 * K * 4 + 4 * triton.cdiv(K, 16))  # dq, dk, dg, dbeta per K block
    return max(state_pass, products, last)


class _KDATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, exact, half):
        ctx.scale, ctx.exact, ctx.half = scale, exact, half
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        return kda_forward(q, k, v, g, beta, scale, initial_state, exact=exact, half=half)

    @staticmethod
    def backward(ctx, do, dS):
        q, k, v, g, beta, s0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros(*q.shape[:3], v.shape[-1], device=q.device, dtype=torch.float32)
        grads = kda_backward(q, k, v, g, beta, ctx.scale, s0, do, dS, exact=ctx.exact, half=ctx.half)
        dq, dk, dv, dg, dbeta, ds0 = (
            gr.to(x.dtype) if gr is not None else None for gr, x in zip(grads, (q, k, v, g, beta, s0))
        )
        return dq, dk, dv, dg, dbeta, None, ds0, None, None


def kda_triton(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float,
    initial_state_BHKV: torch.Tensor | None = None,
    *,
    exact: bool = False,
    half: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kda_reference``: (o [B, T, H, V] fp32, final state [B, H, K, V] fp32).

    ``exact``: fp32 products and buffers ("triton-fp32"). Otherwise products take ``half``
    operands (bf16 or fp16) with fp32 accumulation and the chunk buffers are stored in ``half``:
    pass the model's dtype when it is fp16 (``kda()`` reads it from q before upcasting q and k)."""
    return _KDATriton.apply(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, exact,
                            _check_half(half))
