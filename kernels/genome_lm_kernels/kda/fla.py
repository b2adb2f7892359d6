"""Kimi Delta Attention through fla-core's ``chunk_kda`` (flash-linear-attention's Triton
kernels; GPU only, in the ``gpu`` extra). It takes and returns the recurrent state, which
streaming and context parallel need, and normalises q and k inside its kernels."""

from __future__ import annotations

import torch


def kda_fla(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float,
    initial_state_BHKV: torch.Tensor | None = None,
    *,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32). q and k come unnormalised:
    with ``use_qk_l2norm`` fla applies x / sqrt(sum x^2 + 1e-6), glm5_next's form."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as err:
        raise ImportError("kernel backend 'fla' needs fla-core: pip install 'genome-lm[gpu]' (or fla-core)") from err
    o, state = chunk_kda(
        q_BTHK, k_BTHK, v_BTHV, g_BTHK.float(), beta_BTH.float(), scale=scale,
        initial_state=None if initial_state_BHKV is None else initial_state_BHKV.float(),
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return o, state.float()
