"""The Kimi Delta Attention layer of GLM-5.3-Flash (glm5_next ``Glm5NextTextLinearAttention``).

The layer holds projections, short convolutions, gates and the output norm; the recurrence is
``genome_lm_kernels.kda.kda``. Tensor parallel splits the heads: q/k/v, the decay's second
projection, beta and the output gate's second projection are column-parallel, the output
projection row-parallel; the rank-``head_dim`` first projections of the decay and the output
gate are small and replicated. megatron-core has no KDA; this layer plugs into the stack the
way its gated delta net does, with linear layers from the spec provider.

Shapes: x [S, B, hidden] in, [S, B, hidden] out; inside, heads are [B, S, H_local, head_dim].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from genome_lm_kernels.kda import kda

from .common import BuildOptions, column_linear, replicated_linear, row_linear, tp_shared
from .config import ModelConfig


class KDAState:
    """What a KDA layer carries from one chunk of a sequence to the next (streaming evaluation):
    the last ``conv_kernel - 1`` projected q/k/v inputs [B, 3, W_local, kernel-1] and the fp32
    recurrent state [B, H_local, K, V]."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent


class KDAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tf_config, options: BuildOptions, tp_group):
        super().__init__()
        tp = 1 if tp_group is None else tp_group.size()
        if cfg.linear_num_heads % tp:
            raise ValueError(f"linear_num_heads ({cfg.linear_num_heads}) is not divisible by tensor parallel {tp}")
        self.cfg, self.backend, self.tp_group = cfg, options.kernel_backend, tp_group
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        self.heads, self.head_dim = H // tp, K
        width = H * K
        dtype = options.dtype

        def column(n_in: int, n_out: int):
            return column_linear(options, tf_config, tp_group, n_in, n_out)

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
        self.o_proj = row_linear(options, tf_config, tp_group, width, cfg.hidden_size)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g <= 0, [S, B, H_local, K] fp32."""
        f = self.f_b_proj(self.f_a_proj(x))[0].float() + self.dt_bias.float()
        f = f.unflatten(-1, (self.heads, self.head_dim))
        rate = torch.exp(self.A_log.float())[:, None]
        if self.cfg.linear_lower_bound is not None:
            return self.cfg.linear_lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f, threshold=20.0)

    def short_conv(self, qkv: torch.Tensor, conv_state: torch.Tensor | None):
        """Causal depthwise conv + SiLU. qkv [S, B, 3, W] -> same shape, and the new conv state."""
        S, B, _, W = qkv.shape
        ksize = self.conv_weight.shape[-1]
        x = qkv.permute(1, 2, 3, 0).reshape(B, 3 * W, S).to(torch.float32)
        if conv_state is None:
            x = F.pad(x, (ksize - 1, 0))
        else:
            x = torch.cat([conv_state.reshape(B, 3 * W, ksize - 1).to(torch.float32), x], dim=-1)
        new_state = x[..., -(ksize - 1):].reshape(B, 3, W, ksize - 1) if ksize > 1 else x[..., :0]
        out = F.silu(F.conv1d(x, self.conv_weight.reshape(3 * W, 1, ksize), groups=3 * W))
        return out.reshape(B, 3, W, S).permute(3, 0, 1, 2).to(qkv.dtype), new_state

    def forward(self, x: torch.Tensor, state: KDAState | None = None, *, return_state: bool = False):
        """x [S, B, hidden] -> out [S, B, hidden] (and the carried state if ``return_state``)."""
        S, B, _ = x.shape
        H, K = self.heads, self.head_dim
        qkv = torch.stack([self.q_proj(x)[0], self.k_proj(x)[0], self.v_proj(x)[0]], dim=2)
        qkv, conv_state = self.short_conv(qkv, None if state is None else state.conv)
        q, k, v = (t.reshape(S, B, H, K).transpose(0, 1) for t in qkv.unbind(2))
        g = self.decay(x).transpose(0, 1)
        beta = torch.sigmoid(self.b_proj(x)[0].float()).transpose(0, 1)
        o, final = kda(q, k, v, g, beta, initial_state=None if state is None else state.recurrent,
                       output_final_state=return_state, use_qk_l2norm=True, backend=self.backend)
        gate = self.g_b_proj(self.g_a_proj(x))[0].reshape(S, B, H, K).float()
        o = o.transpose(0, 1).float()  # [S, B, H, K]
        weight = tp_shared(self.o_norm_weight, self.tp_group).float()
        o = weight * (o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps))
        o = (o * torch.sigmoid(gate)).to(x.dtype).reshape(S, B, H * K)
        out = self.o_proj(o)[0]
        return (out, KDAState(conv_state, final)) if return_state else out
