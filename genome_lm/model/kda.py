"""The Kimi Delta Attention layer of GLM-5.3-Flash (glm5_next ``Glm5NextTextLinearAttention``).

The layer holds projections, short convolutions, gates and the output norm; the recurrence is
``genome_lm_kernels.kda.kda``. Tensor parallel splits the heads: q/k/v, the decay's second
projection, beta and the output gate's second projection are column-parallel, the output
projection row-parallel; the rank-``head_dim`` first projections of the decay and the output
gate are small and replicated. megatron-core has no KDA; this layer plugs into the stack the
way its gated delta net does, with linear layers from the spec provider.

Context parallel (``genome_lm.engine.context_parallel``): x holds this rank's zigzag tokens.
Projections, decay, beta and the output gate and norm are per token and run on them; the
recurrence and the short convolution need the true previous tokens, so an all-to-all hands each
rank the whole sequence for heads / cp of its heads (the conv uses those heads' channels of its
weight) and a second one brings the output back.

Shapes: x [S, B, hidden] in, [S, B, hidden] out; inside, heads are [B, S, H_local, head_dim].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from genome_lm.engine.context_parallel import group_size, head_slice, heads_per_rank, heads_to_seq, seq_to_heads
from genome_lm_kernels.kda import kda

from .common import (
    AttentionSubmodules,
    BuildOptions,
    attention_submodules,
    column_linear,
    replicated_linear,
    row_linear,
    tp_shared,
)
from .config import ModelConfig


class KDAState:
    """What a KDA layer carries from one chunk of a sequence to the next (streaming evaluation):
    the last ``conv_kernel - 1`` projected q/k/v inputs [B, 3, W_local, kernel-1] and the fp32
    recurrent state [B, H_local, K, V]."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent


class KDAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tf_config, options: BuildOptions, tp_group, cp_group=None,
                 submodules: AttentionSubmodules | None = None):
        super().__init__()
        if submodules is None:  # built directly, not from a spec: the options' spec provider
            submodules = attention_submodules(options.spec_provider())
        tp, cp = group_size(tp_group), group_size(cp_group)
        heads_per_rank(cfg.linear_num_heads, tp, cp, "linear_num_heads")
        self.cfg, self.backend, self.tp_group, self.cp_group = cfg, options.kernel_backend, tp_group, cp_group
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        self.heads, self.head_dim = H // tp, K
        width = H * K
        dtype = options.dtype

        def column(n_in: int, n_out: int):
            return column_linear(submodules.linear_column, tf_config, tp_group, n_in, n_out)

        self.q_proj, self.k_proj, self.v_proj = column(cfg.hidden_size, width), column(cfg.hidden_size, width), \
            column(cfg.hidden_size, width)
        # depthwise causal conv over [q; k; v] channels, fp32 as in glm5_next: [3, W_local, kernel]
        self.conv_weight = nn.Parameter(torch.empty(3, width // tp, cfg.linear_conv_kernel_dim, dtype=torch.float32))
        nn.init.uniform_(self.conv_weight, -1 / math.sqrt(cfg.linear_conv_kernel_dim),
                         1 / math.sqrt(cfg.linear_conv_kernel_dim))
        self.f_a_proj = replicated_linear(cfg.hidden_size, K, cfg, dtype)
        self.f_b_proj = column(K, width)
        # safe gate: A_log = 0; dt_bias = inverse softplus of dt ~ logU[1e-3, 1e-1] (fla's init)
        self.A_log = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        dt = torch.exp(torch.empty(width // tp).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        if cfg.linear_lower_bound is None:
            self.A_log.data.uniform_(1.0, 16.0).log_()
        self.b_proj = column(cfg.hidden_size, H)
        self.g_a_proj = replicated_linear(cfg.hidden_size, K, cfg, dtype)
        self.g_b_proj = column(K, width)
        self.o_norm_weight = nn.Parameter(torch.ones(K, dtype=dtype))
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for param, dim in ((self.conv_weight, 1), (self.dt_bias, 0), (self.A_log, 0)):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
        self.o_proj = row_linear(submodules.linear_row, tf_config, tp_group, width, cfg.hidden_size)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g <= 0, [S, B, H_local, K] fp32."""
        f = self.f_b_proj(self.f_a_proj(x))[0].float() + self.dt_bias.float()
        f = f.unflatten(-1, (self.heads, self.head_dim))
        rate = torch.exp(self.A_log.float())[:, None]
        if self.cfg.linear_lower_bound is not None:
            return self.cfg.linear_lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f, threshold=20.0)

    def short_conv(self, qkv: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor):
        """Causal depthwise conv + SiLU. qkv [S, B, 3, W] -> same shape, and the new conv state.
        weight [3, W, kernel]: the channels of qkv."""
        S, B, _, W = qkv.shape
        ksize = weight.shape[-1]
        x = qkv.permute(1, 2, 3, 0).reshape(B, 3 * W, S).to(torch.float32)
        if conv_state is None:
            x = F.pad(x, (ksize - 1, 0))
        else:
            x = torch.cat([conv_state.reshape(B, 3 * W, ksize - 1).to(torch.float32), x], dim=-1)
        new_state = x[..., -(ksize - 1):].reshape(B, 3, W, ksize - 1) if ksize > 1 else x[..., :0]
        out = F.silu(F.conv1d(x, weight.reshape(3 * W, 1, ksize), groups=3 * W))
        return out.reshape(B, 3, W, S).permute(3, 0, 1, 2).to(qkv.dtype), new_state

    def forward(self, x: torch.Tensor, state: KDAState | None = None, *, return_state: bool = False):
        """x [S, B, hidden] -> out [S, B, hidden] (and the carried state if ``return_state``)."""
        S, B, _ = x.shape
        H, K = self.heads, self.head_dim
        cp = self.cp_group
        if (state is not None or return_state) and group_size(cp) > 1:
            raise ValueError("streaming with a carried KDA state is not supported under context parallel")
        qkv = torch.stack([self.q_proj(x)[0], self.k_proj(x)[0], self.v_proj(x)[0]], dim=2)  # [S, B, 3, H*K]
        g = self.decay(x)  # [S, B, H, K]
        beta = torch.sigmoid(self.b_proj(x)[0].float())  # [S, B, H]
        # context parallel: whole sequence, this CP rank's heads (identity without CP)
        qkv = seq_to_heads(qkv.unflatten(-1, (H, K)), cp, seq_dim=0, head_dim=3).flatten(-2)
        g = seq_to_heads(g, cp, seq_dim=0, head_dim=2)
        beta = seq_to_heads(beta, cp, seq_dim=0, head_dim=2)
        conv_weight = self.conv_weight[:, head_slice(self.conv_weight.shape[1], cp)]
        qkv, conv_state = self.short_conv(qkv, None if state is None else state.conv, conv_weight)
        T, Hc = qkv.shape[0], qkv.shape[-1] // K
        q, k, v = (t.reshape(T, B, Hc, K).transpose(0, 1) for t in qkv.unbind(2))
        o, final = kda(q, k, v, g.transpose(0, 1), beta.transpose(0, 1),
                       initial_state=None if state is None else state.recurrent,
                       output_final_state=return_state, use_qk_l2norm=True, backend=self.backend)
        o = heads_to_seq(o.transpose(0, 1), cp, seq_dim=0, head_dim=2).float()  # [S, B, H, K]
        gate = self.g_b_proj(self.g_a_proj(x))[0].reshape(S, B, H, K).float()
        weight = tp_shared(self.o_norm_weight, self.tp_group).float()
        o = weight * (o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps))
        o = (o * torch.sigmoid(gate)).to(x.dtype).reshape(S, B, H * K)
        out = self.o_proj(o)[0]
        return (out, KDAState(conv_state, final)) if return_state else out
