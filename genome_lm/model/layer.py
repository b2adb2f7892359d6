"""One decoder layer of GLM-5.3-Flash, built from ``specs.decoder_layer_spec``, and the
sequence-parallel gather/scatter of positions it and the model use."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from .common import BuildOptions, DecoderLayerSubmodules, HyperConnection, RMSNorm, is_dense_mlp
from .config import LINEAR, ModelConfig
from .dsa import IndexerLossMode

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


class DecoderLayer(nn.Module):
    """One layer, built from ``specs.decoder_layer_spec``: mHC -> RMSNorm -> attention (KDA or
    DSA) -> merge, then mHC -> RMSNorm -> MLP (dense or MoE) -> merge."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tf_config, options: BuildOptions, pg: ProcessGroupCollection,
                 submodules: DecoderLayerSubmodules):
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        self.is_kda = cfg.layer_types[layer_idx] == LINEAR
        self.attn_hc = HyperConnection(cfg, options.kernel_backend, options.compiled)
        self.ffn_hc = HyperConnection(cfg, options.kernel_backend, options.compiled)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options.dtype)
        extra = {} if self.is_kda else {"tp_cp_group": pg.tp_cp}
        self.self_attention = build_module(submodules.attention, cfg, layer_idx, tf_config, options, pg.tp, pg.cp,
                                           **extra)
        if is_dense_mlp(submodules.mlp):
            self.mlp = build_module(submodules.mlp, tf_config, ffn_hidden_size=cfg.intermediate_size, tp_group=pg.tp)
        else:
            # Under tensor parallel the MoE layer runs sequence-parallel (megatron-core refuses to
            # train it otherwise): each rank routes its slice of the tokens, see forward().
            self.moe_sequence_parallel = pg.tp.size() > 1
            moe_config = dataclasses.replace(tf_config, sequence_parallel=True) if self.moe_sequence_parallel \
                else tf_config
            self.mlp = submodules.mlp(config=moe_config, layer_number=layer_idx + 1, pg_collection=pg)
            self.mlp.register_forward_hook(_drop_dispatcher_state)
        self.tp_group = pg.tp

    def forward(self, streams: torch.Tensor, idx: torch.Tensor | None, indexer_loss: IndexerLossMode,
                indexer_tokens: int | None = None, cache=None, sp_len: int | None = None):
        """streams [S, B, N, D] -> (streams, selection for a following shared layer, indexer loss).
        ``cache`` (``prefill.KDACache`` / ``DSACache``): streaming evaluation, these S tokens follow
        the ones the cache holds. ``sp_len``: sequence parallel, the streams are this rank's slice
        of ``sp_len`` positions (padded to a multiple of tp)."""
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        if sp_len is not None:
            x = gather_positions(x, sp_len, self.tp_group)
        loss = None
        if cache is not None:
            out, idx = cache.attend(self.self_attention, x, idx)
        elif self.is_kda:
            out = self.self_attention(x)
        else:
            out, idx, loss = self.self_attention(x, idx, indexer_loss, indexer_tokens)
        if sp_len is not None:
            out = scatter_positions(out, self.tp_group)
        streams = self.attn_hc.merge(post, comb, out, streams)
        post, comb, x = self.ffn_hc(streams)
        x = self.post_attention_layernorm(x)
        if sp_len is not None and getattr(self, "moe_sequence_parallel", False):
            out = self.mlp(x)[0]  # already this rank's slice, as the MoE layer expects
        elif sp_len is not None:
            out = scatter_positions(self.mlp(gather_positions(x, sp_len, self.tp_group))[0], self.tp_group)
        elif getattr(self, "moe_sequence_parallel", False):
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region,
                scatter_to_sequence_parallel_region,
            )

            S, pad = x.shape[0], -x.shape[0] % self.tp_group.size()
            if pad:  # zero rows so the tokens split evenly; their outputs are dropped below
                x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
            out = self.mlp(scatter_to_sequence_parallel_region(x, group=self.tp_group))[0]
            # everything after the MoE is replicated over the ranks: split (not reduce) the gradient
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False,
                                                       group=self.tp_group)[:S]
        else:
            out = self.mlp(x)[0]
        return self.ffn_hc.merge(post, comb, out, streams), idx, loss


def gather_positions(x: torch.Tensor, length: int, group) -> torch.Tensor:
    """Sequence parallel -> whole sequence: all-gather the ranks' slices [S / tp, ...] and drop
    the padding rows. Backward keeps the rank's slice of the (replicated) gradient."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)[:length]


def scatter_positions(x: torch.Tensor, group) -> torch.Tensor:
    """Whole sequence (replicated over the TP ranks) -> this rank's slice (its own storage), after
    padding with zero rows to a multiple of tp. Backward all-gathers the slices' gradients."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    pad = -x.shape[0] % group.size()
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    # the split is a view of the whole tensor: copy the slice, or whatever saves it for backward
    # (the mHC merge) keeps the whole sequence alive
    return scatter_to_sequence_parallel_region(x, group=group).clone()


def _drop_dispatcher_state(moe, args, output) -> None:
    """megatron-core's token dispatcher keeps the last call's routing probabilities
    (``local_probs``, with their autograd history) as an attribute, though only that call uses
    them. Under whole-layer recomputation that history is the recomputed layer's graph, which then
    stays alive after backward: about one layer of activations per MoE layer (measured: +290 MiB
    per layer at 16k tokens, so full recompute saved nothing). Dropping it after the call frees it."""
    dispatcher = getattr(moe, "token_dispatcher", None)
    for name, value in list(vars(dispatcher).items() if dispatcher is not None else ()):
        if torch.is_tensor(value) and value.grad_fn is not None:
            setattr(dispatcher, name, None)
