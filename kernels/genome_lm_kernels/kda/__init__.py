"""Kimi Delta Attention: the gated delta rule with per-channel decay.

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T ;  o_t = S_t^T (scale q_t)

``kda()`` holds the sequence math only; a model layer keeps the projections, short convolutions,
the gate (g = lower_bound * sigmoid(...) or -exp(A_log) * softplus(...)), beta = sigmoid(W x) and
the output norm. Conventions follow transformers' glm5_next torch KDA: compute in fp32, optional
q/k L2 normalisation in fp32 (x / sqrt(sum x^2 + 1e-6)), scale K**-0.5, output in q's dtype,
state in fp32.
"""

from __future__ import annotations

from functools import partial

import torch

from genome_lm_kernels import KernelBackend, resolved

__all__ = ["kda", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and glm5_next's form, not F.normalize's)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _native_applies(*tensors: torch.Tensor) -> bool:
    from .native import applies

    return applies(*tensors)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    backend: KernelBackend,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention over a whole sequence.

    Args:
        q, k: [B, T, H, K] queries and keys.
        v: [B, T, H, V] values.
        g: [B, T, H, K] per-channel log-decay, <= 0 (alpha_t = exp(g_t)).
        beta: [B, T, H] write strength, already in [0, 1] (sigmoid applied by the caller).
        scale: multiplies q; default K ** -0.5.
        initial_state: [B, H, K, V] state entering the sequence (streaming, context parallel).
        output_final_state: also return the [B, H, K, V] fp32 state after the last token.
        use_qk_l2norm: L2-normalise q and k over K in fp32 first (glm5_next passes True).
        backend: from ``genome_lm_kernels.resolve_backend``; its ``kda`` path is "reference"
            (token loop), "torch" (chunked, CPU), "triton" (chunked GPU kernels:
            tensor-core products in q's half type, fp16 for fp16 inputs and bf16 otherwise, or fp32
            ones for "triton-fp32") or "fla" (fla-core's
            ``chunk_kda``, GPU only).

    Returns:
        (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or None).
    """
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share [B, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H]; got {tuple(v.shape)}, {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V]; got {tuple(initial_state.shape)}")
    path = resolved(backend, "kda").kda
    scale = K**-0.5 if scale is None else scale

    out_dtype = q.dtype
    if path == "fla":  # fla normalises q and k inside its kernels, from their own dtype
        from .fla import kda_fla

        o, state = kda_fla(q, k, v, g, beta, scale, initial_state, use_qk_l2norm=use_qk_l2norm)
        return o.to(out_dtype), (state if output_final_state else None)
    q_in = q
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if path == "reference":
        from .reference import kda_reference as run
    elif path == "torch" and backend.native and _native_applies(q_in, v, g, beta):
        from .native import kda_native as run  # the token recurrence in C (small heads)
    elif path == "torch":
        from .chunked import kda_chunked as run
    else:
        from .triton import kda_triton

        # products and chunk buffers in the input's half type, as fla does: fp16 in, fp16 products
        half = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
        run = partial(kda_triton, exact=backend.exact, half=half)
    o, state = run(q, k, v, g, beta, scale, initial_state)
    return o.to(out_dtype), (state if output_final_state else None)
