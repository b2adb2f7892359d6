"""Kimi Delta Attention, one token at a time: the readable definition every fast path is tested
against (autograd through it gives the reference gradients).

Per head, with state S_t [K, V], per-channel log-decay g_t [K] (<= 0), beta_t in [0, 1]:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)
Written as decay, read the memory, write the correction:
    S' = exp(g_t)[:, None] * S_{t-1};  S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T
"""

from __future__ import annotations

import torch


def kda_reference(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float,
    initial_state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in fp32. Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32).

    Inputs are used as given: q/k normalisation and dtype handling live in ``kda()``.
    """
    q, k, v, g, beta = (x.float() for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V) if initial_state_BHKV is None else initial_state_BHKV.float()
    outputs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # Diag(exp(g_t)) S_{t-1}
        read_BHV = (k[:, t, :, :, None] * S).sum(-2)  # S'^T k_t
        delta_BHV = beta[:, t, :, None] * (v[:, t] - read_BHV)
        S = S + k[:, t, :, :, None] * delta_BHV[:, :, None, :]
        outputs.append((scale * q[:, t, :, :, None] * S).sum(-2))
    o = torch.stack(outputs, dim=1) if T else v.new_zeros(B, 0, H, V)
    return o, S
