"""The memory techniques, each a config switch applied to a built model from outside.

- recompute: "full" re-runs each decoder layer in the backward pass instead of keeping its
  activations (only the layer input is saved); with ``recompute_nested`` its attention and
  MLP/MoE blocks are checkpointed inside it as well, so the layer's backward holds one block's
  activations at a time; "selective" recomputes the chosen submodules (attention, mlp/moe).
  torch.utils.checkpoint, non-reentrant, so RNG state and the DSA selection handed between
  layers are reproduced exactly. Each checkpointed call carries a ``recompute_memo.Memo``: with
  ``dsa_keep_selection`` a DSA layer's recomputed forward takes the token selection its forward
  made (4 bytes per position and selected pool) instead of running the O(T^2) indexer again.
- DSA query chunks: each DSA layer's indexer, sparse attention and indexer loss take
  ``dsa_query_chunk`` queries per block (the kernels' default is 64).
- MoE in chunks: the tokens go through each MoE layer ``moe_chunks`` at a time, so the dispatch
  buffers of only one chunk exist at once (the published run used 64 chunks at 512k); with
  ``moe_chunk_recompute`` each chunk is checkpointed too, so the MoE's saved activations are
  one chunk's at a time, for one more forward of the experts.
- offload: the tensors autograd saves for backward are moved to host memory (pinned or
  pageable) with torch's saved-tensor hooks, and the pinned-memory cache is released after the
  step (pinned blocks round up to powers of two and ran a node out of RAM in the published run).
  megatron-core's own offloading needs Transformer Engine and CUDA streams (docs/design.md, section 3).

Each function changes the model in place and returns nothing; ``apply_memory`` applies a
``MemoryConfig``. Tests check each gives the same loss and gradients as the plain model.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from genome_lm.engine.backend import current, on_gpu
from genome_lm.model import recompute_memo
from genome_lm.model.recompute_memo import Memo

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model


# The wrappers replace a module's ``forward`` on the instance instead of nesting modules, so
# parameter names (and with them checkpoints) do not change.

def checkpointed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under activation checkpointing (non-reentrant) when autograd
    records, with a ``Memo`` for what its recompute may replay."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    memo = Memo()  # what this call's forward records for its recompute
    return checkpoint(fn, *args, use_reentrant=False, context_fn=memo.contexts, **kwargs)


def recompute(module: nn.Module) -> None:
    """Run ``module`` under activation checkpointing (non-reentrant)."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpointed(inner, *args, **kwargs)

    module.forward = forward
    module.recomputed = True


def chunk_moe(moe: nn.Module, chunks: int, recompute_chunks: bool = False) -> None:
    """Pass x [S, B, D] through the MoE layer ``chunks`` slices of the sequence at a time; with
    ``recompute_chunks`` each slice is checkpointed on its own, so that the MoE's backward holds
    one slice's activations at a time (and its forward keeps none but the slices' input)."""
    inner = moe.forward

    def one(part: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return inner(part, *args, **kwargs)[0]

    run = functools.partial(checkpointed, one) if recompute_chunks else one

    def forward(x: torch.Tensor, *args, **kwargs):
        return torch.cat([run(part, *args, **kwargs) for part in x.chunk(chunks, dim=0)], dim=0), None

    moe.forward = forward
    moe.moe_chunks = chunks
    moe.recompute_chunks = recompute_chunks


def _is_moe(module: nn.Module) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(module, MoELayer)


def apply_recompute(model: GLM5Model, mode: str, modules=("attention",), nested: bool = False) -> None:
    """``nested`` (with "full"): the attention and MLP/MoE blocks are checkpointed inside each
    recomputed layer too, so the layer's backward recomputes and holds one block at a time."""
    if mode == "none":
        return
    for layer in model.layers:
        mlp_checkpointed = getattr(layer.mlp, "recompute_chunks", False)  # a MoE whose chunks are checkpointed
        if mode == "full":
            if nested:
                recompute(layer.self_attention)
                if not mlp_checkpointed:
                    recompute(layer.mlp)
            recompute(layer)
            continue
        if "attention" in modules:
            recompute(layer.self_attention)
        if ("mlp" in modules and not _is_moe(layer.mlp)) or ("moe" in modules and _is_moe(layer.mlp)):
            if not mlp_checkpointed:
                recompute(layer.mlp)


def apply_moe_chunks(model: GLM5Model, chunks: int, recompute_chunks: bool = False) -> None:
    if chunks <= 1:
        return
    for layer in model.layers:
        if _is_moe(layer.mlp):
            chunk_moe(layer.mlp, chunks, recompute_chunks)


@contextlib.contextmanager
def offload_saved_tensors(enabled: bool, pinned: bool):
    """Keep autograd's saved tensors (and what a recomputed forward replays, such as the DSA
    selection) in host memory during forward+backward of one step."""
    if not enabled:
        yield
        return

    pin = pinned and current().pinned_host_memory
    with torch.autograd.graph.save_on_cpu(pin_memory=pin), recompute_memo.on_host(pinned=pin):
        yield


def release_host_cache() -> None:
    """Give the pinned host blocks cached by the CUDA host allocator back to the system."""
    if on_gpu() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def apply_dsa_query_chunk(model: GLM5Model, chunk: int | None) -> None:
    """Queries per block through each DSA layer's indexer, sparse attention and indexer loss:
    bounds their per-block transients ([chunk, T / kpool] indexer scores, gathered keys)."""
    if chunk is None:
        return
    from genome_lm.model.dsa import DSAAttention

    for layer in model.layers:
        if isinstance(layer.self_attention, DSAAttention):
            layer.self_attention.query_chunk = chunk


def apply_dsa_keep_selection(model: GLM5Model, keep: bool) -> None:
    """Whether a recomputed DSA layer replays its forward's token selection (``keep``) or runs
    the indexer again."""
    from genome_lm.model.dsa import DSAAttention

    for layer in model.layers:
        if isinstance(layer.self_attention, DSAAttention):
            layer.self_attention.keep_selection = keep


def apply_memory(model: GLM5Model, memory) -> None:
    """Apply a ``config.MemoryConfig`` (chunking first, so recompute wraps the chunked MoE)."""
    apply_dsa_query_chunk(model, memory.dsa_query_chunk)
    apply_dsa_keep_selection(model, memory.dsa_keep_selection)
    apply_moe_chunks(model, memory.moe_chunks, memory.moe_chunk_recompute)
    apply_recompute(model, memory.recompute, tuple(memory.recompute_modules), memory.recompute_nested)
