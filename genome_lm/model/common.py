"""Pieces shared by the layers: megatron-core's config and spec provider, RMSNorm, mHC.

Layout: inside the stack activations are sequence-first, ``[S, B, ...]``, as megatron-core's
modules expect; the mHC residual streams are ``[S, B, N, hidden]`` with N = ``hc_mult``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from genome_lm_kernels import KernelBackend, resolve_backend
from genome_lm_kernels.cpu import native

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
        through ``torch.compile`` (``compiled_sinkhorn``): the same arithmetic in a few fused
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

    from genome_lm.engine.backend import current

    backend = current()
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


def _sinkhorn_steps(z: torch.Tensor, iters: int, eps: float, keep: list | None = None) -> torch.Tensor:
    """softmax over columns + eps, then column, (row, column) x (iters - 1) normalisations, each
    x / (sum + eps), on token-last matrices: ``z`` [N (row i), N (column j), M tokens]. Keeping the
    tokens innermost lets every sum and division run vectorised over the tokens (with N = 4 last,
    each op worked on 4-element rows, about 4x slower at 2k tokens). ``keep`` collects (output,
    sum + eps, dim) of every normalisation."""
    c = torch.softmax(z, dim=1) + eps
    for dim in [0] + [1, 0] * (iters - 1):
        denom = c.sum(dim, keepdim=True) + eps
        c = c / denom if keep is not None else c.div_(denom)
        if keep is not None:
            keep.append((c, denom, dim))
    return c


def _tokens_last(x: torch.Tensor) -> torch.Tensor:
    """[.., N, N] -> [N, N, M] contiguous (M = the leading dims flattened)."""
    n = x.shape[-1]
    return x.reshape(-1, n, n).permute(1, 2, 0).contiguous()


def _c_takes(*tensors: torch.Tensor) -> bool:
    """Whether mHC's C kernels (``genome_lm_kernels/cpu/mhc.c``: the Sinkhorn, collapse, merge)
    take these inputs: every one fp32 on the CPU. They run where this holds and the backend's
    ``native`` is on (``HyperConnection(native_ok=...)``)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _run_tokens(fn: str, tokens: int, args_for) -> None:
    """``cpu/mhc.c``'s ``fn`` over ``tokens`` tokens, split over torch's threads; ``args_for(m0, m1)``."""
    native.run_rows(getattr(native.library("mhc"), fn), native.split_rows(tokens), lambda i, m0, m1: args_for(m0, m1))


class _Sinkhorn(torch.autograd.Function):
    """The mHC Sinkhorn normalisation with a backward that recomputes the iterations: it saves
    only its input (N * N values per token) where autograd through the loop keeps every
    iteration (about 5 KiB per token per call at N = 4, 20 iterations), and runs a few fused
    steps per iteration instead of autograd's graph. Tokens are processed in blocks in backward
    so the recomputed iterations stay bounded."""

    BLOCK = 1 << 16  # tokens per recomputation block

    @staticmethod
    def forward(ctx, z, iters: int, eps: float, compiled: bool = False, native_ok: bool = False):
        ctx.save_for_backward(z)
        ctx.iters, ctx.eps, ctx.native = iters, eps, native_ok and _c_takes(z)
        if ctx.native:  # genome_lm_kernels' C kernel, forward and backward
            return _sinkhorn_native("mhc_sinkhorn_fwd", z, None, iters, eps)
        steps_fn, ctx.grad_fn = compiled_sinkhorn() if compiled else (_sinkhorn_steps, _sinkhorn_grad)
        # contiguous, tokens first again: a batched matmul on a tokens-last view (merge's comb^T @
        # streams) falls back to one small product per token on CPU, 15x slower
        return steps_fn(_tokens_last(z), iters, eps).permute(2, 0, 1).reshape(z.shape).contiguous()

    @staticmethod
    def backward(ctx, grad):
        (z,) = ctx.saved_tensors
        if ctx.native:
            return _sinkhorn_native("mhc_sinkhorn_bwd", z, grad, ctx.iters, ctx.eps), None, None, None, None
        zt, gt = _tokens_last(z), _tokens_last(grad)
        dz = torch.empty_like(zt)
        for a in range(0, zt.shape[-1], _Sinkhorn.BLOCK):
            dz[..., a:a + _Sinkhorn.BLOCK] = ctx.grad_fn(zt[..., a:a + _Sinkhorn.BLOCK],
                                                         gt[..., a:a + _Sinkhorn.BLOCK], ctx.iters, ctx.eps)
        return dz.permute(2, 0, 1).reshape(z.shape), None, None, None, None


def _sinkhorn_grad(z: torch.Tensor, g: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The gradient of ``_sinkhorn_steps`` at token-last ``z`` for the output gradient ``g``:
    the iterations recomputed, then walked back."""
    steps: list = []
    _sinkhorn_steps(z, iters, eps, steps)
    for y, denom, dim in reversed(steps):  # y = x / denom, denom = sum(x) + eps
        g = (g - (g * y).sum(dim, keepdim=True)) / denom
    p = torch.softmax(z, dim=1)
    return p * (g - (g * p).sum(1, keepdim=True))


def _sinkhorn_native(fn: str, z: torch.Tensor, grad: torch.Tensor | None, iters: int, eps: float) -> torch.Tensor:
    """The Sinkhorn forward (``grad`` None) or its gradient at z, in C on token-last matrices;
    threads over tokens. Matches ``_sinkhorn_steps`` / ``_sinkhorn_grad``."""
    n = z.shape[-1]
    zt = _tokens_last(z)
    args = (zt,) if grad is None else (zt, _tokens_last(grad.float()))
    M = zt.shape[-1]
    out = torch.empty_like(zt)
    ptrs = [native.ptr(a) for a in args]
    _run_tokens(fn, M, lambda m0, m1: (*ptrs, M, n, iters, eps, m0, m1, native.ptr(out)))
    return out.permute(2, 0, 1).reshape(z.shape).contiguous()


class _Collapse(torch.autograd.Function):
    """The block's input sum_n pre[n] * streams[n] in C: pre [.., N] and streams [.., N, D] fp32
    -> [.., D]; backward in one pass per token too."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        pre, streams = native.f32(pre), native.f32(streams)
        ctx.save_for_backward(pre, streams)
        N, D = streams.shape[-2:]
        x = streams.new_empty(streams.shape[:-2] + (D,))
        _run_tokens("mhc_collapse_fwd", pre.numel() // N, lambda m0, m1: (
            native.ptr(pre), native.ptr(streams), N, D, m0, m1, native.ptr(x)))
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        pre, streams = ctx.saved_tensors
        g = native.f32(g)
        N, D = streams.shape[-2:]
        dpre, ds = torch.empty_like(pre), torch.empty_like(streams)
        _run_tokens("mhc_collapse_bwd", pre.numel() // N, lambda m0, m1: (
            native.ptr(pre), native.ptr(streams), native.ptr(g), N, D, m0, m1, native.ptr(dpre), native.ptr(ds)))
        return dpre, ds


class _Merge(torch.autograd.Function):
    """``HyperConnection.merge`` in C: post [.., N], comb [.., N, N], block_out [.., D] and
    streams [.., N, D], all fp32 -> the new streams [.., N, D]; backward in one pass per token."""

    @staticmethod
    def forward(ctx, post, comb, block_out, streams):
        post, comb, block_out, streams = (native.f32(t) for t in (post, comb, block_out, streams))
        ctx.save_for_backward(post, comb, block_out, streams)
        N, D = streams.shape[-2:]
        out = torch.empty_like(streams)
        _run_tokens("mhc_merge_fwd", post.numel() // N, lambda m0, m1: (
            *(native.ptr(t) for t in (post, comb, block_out, streams)), N, D, m0, m1, native.ptr(out)))
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        post, comb, block_out, streams = ctx.saved_tensors
        g = native.f32(g)
        N, D = streams.shape[-2:]
        grads = [torch.empty_like(t) for t in (post, comb, block_out, streams)]
        _run_tokens("mhc_merge_bwd", post.numel() // N, lambda m0, m1: (
            *(native.ptr(t) for t in (post, comb, block_out, streams, g)), N, D, m0, m1,
            *(native.ptr(t) for t in grads)))
        return tuple(grads)


_COMPILED: tuple | None = None


def compiled_sinkhorn() -> tuple:
    """(``_sinkhorn_steps``, ``_sinkhorn_grad``) through ``torch.compile`` (dynamic shapes: one
    compilation serves every number of tokens), made once per process. On 2 CPU cores at 2,048
    tokens the forward took 0.17 ms instead of 0.46 and the gradient 0.39 ms instead of 4.2, with
    bit-identical results; compiling takes about 30 s the first time (inductor writes C++ and
    caches it on disk), a few seconds after."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = (torch.compile(_sinkhorn_steps, dynamic=True), torch.compile(_sinkhorn_grad, dynamic=True))
    return _COMPILED


def sinkhorn(z: torch.Tensor, iters: int, eps: float, compiled: bool = False, native_ok: bool = False
             ) -> torch.Tensor:
    """[.., N, N] logits -> approximately doubly stochastic [.., N, N] (see ``HyperConnection``);
    ``compiled``: through ``compiled_sinkhorn``."""
    return _Sinkhorn.apply(z, iters, eps, compiled, native_ok)


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection (mHC) around one block (attention or MLP).

    From the N residual streams it computes, with one linear map of the RMS-normalised
    flattened streams: ``pre`` [.., N] (collapses the streams into the block's input), ``post``
    [.., N] (spreads the block's output over the streams) and ``comb`` [.., N, N] (mixes the
    residual streams; Sinkhorn-normalised to be doubly stochastic so the residual cannot grow).
    Parameters and arithmetic follow transformers' ``Glm5NextTextHyperConnection``; fn, base
    and scale are kept in fp32.
    """

    def __init__(self, cfg: ModelConfig, compiled: bool = False, native_ok: bool = False):
        super().__init__()
        self.compiled = compiled  # the Sinkhorn steps through torch.compile (BuildOptions.compiled)
        self.native = native_ok  # C kernels for fp32 CPU inputs (the kernel backend's ``native``)
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
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), self.iters, self.eps,
                        self.compiled, self.native)
        if self.native and _c_takes(pre, streams):
            block_in = _Collapse.apply(pre, streams)
        else:
            block_in = (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)
        return post, comb, block_in

    def merge(self, post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
              ) -> torch.Tensor:
        """New streams: post * block output + comb^T @ old streams."""
        if self.native and _c_takes(post, comb, block_out, streams):
            return _Merge.apply(post, comb, block_out, streams)
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


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
