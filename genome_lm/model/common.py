"""Pieces shared by the layers: megatron-core's config and spec provider, RMSNorm, mHC's module.

Layout: inside the stack activations are sequence-first, ``[S, B, ...]``, as megatron-core's
modules expect; the mHC residual streams are ``[S, B, N, hidden]`` with N = ``hc_mult``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from genome_lm.engine import backend as engine_backend  # its current() read at each call (tests swap it)
from genome_lm_kernels import KernelBackend, mhc, resolve_backend

from .config import ModelConfig

if TYPE_CHECKING:
    from genome_lm.engine.parallel import ParallelSizes

TransformerImpl = Literal["local", "transformer_engine"]


@dataclass(frozen=True)
class BuildOptions:
    """Choices made once when a model is built (never read from globals later).

    transformer_impl: megatron-core's spec provider, "local" (torch, CPU) or
        "transformer_engine" (GPU, needs the ``gpu`` extra).
    kernel_backend: backend of the KDA and DSA ops, resolved once with
        ``genome_lm_kernels.resolve_backend`` (``build_model`` does it); the layers pass it on.
    dtype: parameter dtype.
    moe_aux_loss_coeff: weight of the MoE routers' auxiliary load-balancing loss (0: none, the
        expert bias alone balances the load); it joins backward as a gradient only
        (``router.py``).
    moe_aux_loss: megatron-core's load-balancing type for it: "seq_aux_loss" (per sequence, as
        DeepSeek-V3) or "aux_loss" (per micro-batch).
    absorbed_mla: the DSA layers attend over the shared MLA latent with absorbed queries
        (``genome_lm_kernels.dsa.sparse_mla``, tensor cores on a GPU) instead of per-head keys
        and values (``sparse_attention``); the same function, another order of products.
    compiled: the mHC Sinkhorn normalisation (forward and its backward's recomputation) runs
        through ``torch.compile`` (``genome_lm_kernels.mhc.recompute.compiled``): the same arithmetic in a few fused
        kernels instead of about 270 small ops per hyper-connection and step (``model.compile``).
    split_dsa_selection: the DSA selection and indexer loss are shared out over the tensor x
        context parallel group instead of repeated on every rank (``dsa.py``; the same results).
    shared_expert_overlap: megatron-core's MoE layer runs the shared expert on its own CUDA stream
        while the routed tokens' all-to-alls run (``parallel.moe_shared_expert_overlap``; needs the
        all-to-all dispatcher, so the GPU backend).
    """

    transformer_impl: TransformerImpl = "local"
    kernel_backend: KernelBackend = field(default_factory=lambda: resolve_backend("torch", "cpu"))
    dtype: torch.dtype = torch.float32
    moe_aux_loss_coeff: float = 0.0
    moe_aux_loss: Literal["seq_aux_loss", "aux_loss"] = "seq_aux_loss"
    absorbed_mla: bool = False
    compiled: bool = False
    split_dsa_selection: bool = True
    shared_expert_overlap: bool = False

    def spec_provider(self):
        if self.transformer_impl == "transformer_engine":
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            return TESpecProvider()
        from megatron.core.models.backends import LocalSpecProvider

        return LocalSpecProvider()


def megatron_config(cfg: ModelConfig, sizes: ParallelSizes, options: BuildOptions):
    """The megatron-core ``MLATransformerConfig`` (a ``TransformerConfig``) its MLP, MoE and
    parallel linear layers read, with the MLA, DSA-indexer and linear-attention sizes filled in
    from the model config. genome-lm's own KDA and DSA layers read their sizes from the model
    config, not from these fields. Fusions stay off: the swiglu clamp of glm5_next (gate <= limit, up in
    [-limit, limit]) is applied by megatron-core's unfused GLU through
    ``activation_func_clamp_value``."""
    from megatron.core.transformer import MLATransformerConfig

    backend = engine_backend.current()
    return MLATransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.v_head_dim,
        # the DSA layers' MLA: low-rank q and kv, no positional part (qk_rope_head_dim = 0)
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=0,
        v_head_dim=cfg.v_head_dim,
        rope_type="rope",
        # the DSA indexer and the KDA layers, for readers of the config (genome-lm's layers
        # take them from the model config)
        dsa_indexer_n_heads=cfg.index_n_heads,
        dsa_indexer_head_dim=cfg.index_head_dim,
        dsa_indexer_topk=cfg.index_topk,
        linear_key_head_dim=cfg.linear_head_dim,
        linear_value_head_dim=cfg.linear_head_dim,
        linear_num_key_heads=cfg.linear_num_heads,
        linear_num_value_heads=cfg.linear_num_heads,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        layernorm_epsilon=cfg.rms_norm_eps,
        normalization="RMSNorm",
        init_method_std=cfg.initializer_range,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        activation_func_clamp_value=cfg.swiglu_limit,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=backend.cpu_initialization,
        params_dtype=options.dtype,
        bf16=options.dtype == torch.bfloat16,
        transformer_impl=options.transformer_impl,
        tensor_model_parallel_size=sizes.tp,
        context_parallel_size=sizes.cp,
        pipeline_model_parallel_size=getattr(sizes, "pp", 1),
        pipeline_dtype=options.dtype,
        # stages exchange the mHC streams with isend/irecv pairs (gloo has no batched p2p sync)
        batch_p2p_comm=backend.batch_p2p,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        num_moe_experts=cfg.n_routed_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.shared_expert_size,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type=options.moe_aux_loss if options.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=options.moe_aux_loss_coeff,
        moe_token_dispatcher_type=backend.moe_dispatcher,
        moe_shared_expert_overlap=options.shared_expert_overlap,
        moe_grouped_gemm=False,
    )


class RMSNorm(nn.Module):
    """glm5_next's RMSNorm: normalise in fp32, cast back, then scale by the weight."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection (mHC) around one block (attention or MLP).

    From the N residual streams it computes, with one linear map of the RMS-normalised
    flattened streams: ``pre`` [.., N] (collapses the streams into the block's input), ``post``
    [.., N] (spreads the block's output over the streams) and ``comb`` [.., N, N] (mixes the
    residual streams; Sinkhorn-normalised to be doubly stochastic so the residual cannot grow).
    Parameters and arithmetic follow transformers' ``Glm5NextTextHyperConnection``; fn, base
    and scale are kept in fp32. The Sinkhorn, the collapse into the block's input and the merge
    are ``genome_lm_kernels.mhc``'s ops, run as the kernel backend says.
    """

    def __init__(self, cfg: ModelConfig, backend: KernelBackend, compiled: bool = False):
        super().__init__()
        self.backend = backend  # what its ops run (genome_lm_kernels.mhc): reference, torch, C where native
        self.compiled = compiled  # the Sinkhorn steps through torch.compile (BuildOptions.compiled)
        n = cfg.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        nn.init.normal_(self.fn, std=0.02)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [S, B, N, D] -> (post [S, B, N] fp32, comb [S, B, N, N] fp32, block input [S, B, D])."""
        n = self.n
        flat = streams.flatten(-2).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = mhc.sinkhorn(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), self.iters, self.eps,
                            backend=self.backend, compiled=self.compiled)
        return post, comb, mhc.collapse(pre, streams, backend=self.backend)

    def merge(self, post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
              ) -> torch.Tensor:
        """New streams: post * block output + comb^T @ old streams."""
        return mhc.merge(post, comb, block_out, streams, backend=self.backend)


def column_linear(spec, tf_config, tp_group, n_in: int, n_out: int):
    """A column-parallel projection (output features split over tensor-parallel ranks), no bias;
    ``spec``: the spec provider's column-parallel class (or a ``ModuleSpec`` of one)."""
    from megatron.core.transformer.spec_utils import build_module

    return build_module(
        spec, n_in, n_out, config=tf_config, init_method=tf_config.init_method, bias=False, gather_output=False,
        skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=tp_group)


def row_linear(spec, tf_config, tp_group, n_in: int, n_out: int):
    """A row-parallel output projection (input features split, result summed over ranks), no
    bias; ``spec``: the spec provider's row-parallel class (or a ``ModuleSpec`` of one)."""
    from megatron.core.transformer.spec_utils import build_module

    return build_module(
        spec, n_in, n_out, config=tf_config, init_method=tf_config.output_layer_init_method, bias=False,
        input_is_parallel=True, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=tp_group)


def replicated_linear(in_features: int, out_features: int, cfg: ModelConfig, dtype: torch.dtype) -> nn.Linear:
    """A small projection every tensor-parallel rank holds whole (its inputs are replicated)."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    nn.init.normal_(layer.weight, std=cfg.initializer_range)
    return layer


def tp_shared(weight: torch.Tensor, tp_group) -> torch.Tensor:
    """Use a replicated parameter on tensor-parallel-split data: identity forward, all-reduce of
    its gradient backward (each rank only sees its own heads' contribution)."""
    if tp_group is None or tp_group.size() == 1:
        return weight
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(weight, group=tp_group)


# ------------------------------------------------------------------ submodules named by the specs
@dataclass
class AttentionSubmodules:
    """The parallel linear classes (or specs) a KDA or DSA layer builds its projections from:
    ``linear_column`` splits the output features over tensor-parallel ranks (q/k/v, gates,
    the MLA up-projections), ``linear_row`` the input features (the output projection)."""

    linear_column: Any
    linear_row: Any


@dataclass
class DecoderLayerSubmodules:
    """What one decoder layer holds besides its mHC and norms: the attention (KDA or DSA) and
    the MLP (dense ``MLP`` or megatron-core's ``MoELayer`` builder)."""

    attention: Any
    mlp: Any


def attention_submodules(provider) -> AttentionSubmodules:
    """The provider's column- and row-parallel linear classes."""
    return AttentionSubmodules(linear_column=provider.column_parallel_linear(),
                               linear_row=provider.row_parallel_linear())


def is_dense_mlp(spec) -> bool:
    """A dense-MLP spec (a ``ModuleSpec``), not megatron-core's MoE builder (a ``partial``)."""
    return hasattr(spec, "module")
