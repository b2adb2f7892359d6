"""One training step's forward and backward: the one the trainer runs, and the one the planner's
measurements (``plan.measure``: ``bench sweep``, preflight's slice) and ``bench model`` run, so
that what they time and measure is what training does.

    forward_backward(model, micro-batches, StepSpec), for each micro-batch:
        model.hidden -> final hidden states [S, B, D] and the DSA layers' indexer losses
        -> output layer + weighted cross-entropy (blocks of ``memory.loss_chunk`` positions when
           set: only one block's logits exist at a time, recomputed in backward)
        -> backward() of lm + indexer_coeff x indexer losses,
    all under ``memory.offload_activations`` (autograd's saved tensors in host memory). Under
    pipeline parallel the micro-batches go through the 1F1B schedule (``train.pipeline``) and
    each stage runs its part: the indexer losses of its DSA layers, the LM loss on the last.

The memory switches that change the model itself (recompute, MoE and DSA query chunks) are
applied once to the built model (``train.memory.apply_memory``); the ones read here act on the
step. The MoE auxiliary loss needs nothing here: the routers add its gradient inside backward
(``model.router``). Gradients accumulate in the parameters (or megatron-core DDP's buffers): the
caller zeroes them first and reduces them across ranks after.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, NamedTuple, Protocol, Sequence

import torch

from .loss import LossParts, chunked_lm_loss, lm_loss
from .memory import offload_saved_tensors

if TYPE_CHECKING:
    from genome_lm.config import MemoryConfig, RunConfig
    from genome_lm.model.model import GLM5Model


class TokenBatch(Protocol):
    """What a step reads of a micro-batch (``data.loader.Batch`` has these and more)."""

    tokens: torch.Tensor  # [B, T] int64 inputs
    labels: torch.Tensor  # [B, T] int64 next-token targets, IGNORE (< 0) where none
    loss_weight: torch.Tensor  # [B, T] float32, 0 where no target


class Tokens(NamedTuple):
    """A micro-batch made up by a caller without a data loader (the planner, ``bench model``)."""

    tokens: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T]
    loss_weight: torch.Tensor  # [B, T]


@dataclass(frozen=True)
class StepSpec:
    """Everything a step needs besides the model and the micro-batches."""

    memory: MemoryConfig  # read here: loss_chunk, offload_activations, offload_pinned
    mode: str  # the DSA indexer loss: "off", "dense" or "sparse"
    global_weight: torch.Tensor  # sum of the loss weights over the whole global batch (the same on every rank)
    indexer_coeff: float = 1.0  # factor on each micro-batch's indexer losses in what backward runs on
    indexer_tokens: int | None = None  # positions the indexer loss covers (the rest is context-parallel padding)
    tp_group: Any = None  # the vocabulary-parallel cross-entropy's group (None: the whole vocabulary here)
    # entered around the backward of every micro-batch but the last: megatron-core DDP's ``no_sync``
    # under ``parallel.overlap_grad_reduce``, so that buckets are reduced during the last backward only
    no_sync: Callable[[], ContextManager] | None = None


def indexer_mode(run: RunConfig, step: int | None) -> str:
    """The DSA indexer loss at optimizer step ``step`` (0-based): dense during
    ``train.indexer_dense_steps``, then the config's; ``step`` None: the config's."""
    if step is not None and step < run.train.indexer_dense_steps:
        return "dense"
    return run.train.indexer_loss


def step_spec(run: RunConfig, *, global_weight: torch.Tensor, step: int | None = None, micro_batches: int = 1,
              data_parallel: int = 1, tp_group: Any = None, indexer_tokens: int | None = None,
              no_sync: Callable[[], ContextManager] | None = None, memory: MemoryConfig | None = None) -> StepSpec:
    """The one way a run's step is specified (the trainer, the planner's measurements, tests):
    ``run``'s memory switches (or ``memory``), its indexer-loss mode at ``step`` and its indexer
    coefficient shared over the ``data_parallel`` x ``micro_batches`` micro-batches of the global
    batch, whose weight is ``global_weight``."""
    return StepSpec(memory=memory or run.memory, mode=indexer_mode(run, step), global_weight=global_weight,
                    indexer_coeff=run.train.indexer_loss_coeff / (data_parallel * micro_batches),
                    indexer_tokens=indexer_tokens, tp_group=tp_group, no_sync=no_sync)


class StepSums(NamedTuple):
    """This rank's (and pipeline stage's) share of the step's losses, detached, fp32, on the CPU."""

    lm_sum: torch.Tensor  # sum of weight x cross-entropy over its tokens: / global_weight gives its part of the LM loss
    indexer: torch.Tensor  # sum of its DSA layers' indexer losses, averaged over the micro-batches


def forward_backward(model: GLM5Model, micro: Sequence[TokenBatch], spec: StepSpec) -> StepSums:
    """Forward and backward of every micro-batch of ``micro`` (the 1F1B schedule when the model
    is one stage of a pipeline); returns this rank's loss sums (``StepSums``)."""
    if model.pg.pp.size() > 1:
        return _pipeline_forward_backward(model, micro, spec)
    lm_sum, indexer = torch.zeros(()), torch.zeros(())
    for i, batch in enumerate(micro):
        with _offload(spec.memory):  # the saved tensors of one micro-batch at a time
            parts = forward_loss(model, batch, spec)
            with _deferred_sync(spec, last=i == len(micro) - 1):
                parts.total.backward()
        lm_sum += parts.lm_sum.float().cpu()
        indexer += parts.indexer.float().cpu() / len(micro)
    return StepSums(lm_sum, indexer)


def forward_loss(model: GLM5Model, batch: TokenBatch, spec: StepSpec) -> LossParts:
    """One micro-batch's loss parts (``LossParts.total`` is what backward runs on)."""
    device = _device(model)
    h_SBD, indexer_losses = model.hidden(batch.tokens.to(device), spec.mode, spec.indexer_tokens)
    return head_loss(model, h_SBD, batch, indexer_losses, spec)


def head_loss(model: GLM5Model, h_SBD: torch.Tensor, batch: TokenBatch, indexer_losses, spec: StepSpec) -> LossParts:
    """Loss parts from the final hidden states: the output layer and the weighted cross-entropy,
    in blocks of ``memory.loss_chunk`` positions when set (the logits of the whole sequence,
    [T, V / tp], are the largest activation of a long window), plus the indexer losses."""
    device = _device(model)
    labels_BT, weights_BT = batch.labels.to(device), batch.loss_weight.to(device)
    common = dict(global_weight=spec.global_weight, indexer_losses=indexer_losses, indexer_coeff=spec.indexer_coeff,
                  tp_group=spec.tp_group)
    if spec.memory.loss_chunk:
        return chunked_lm_loss(model.output_layer, h_SBD, labels_BT, weights_BT, chunk=spec.memory.loss_chunk, **common)
    logits_BTV = model.output_layer(h_SBD)[0].transpose(0, 1)
    return lm_loss(logits_BTV, labels_BT, weights_BT, **common)


def _pipeline_forward_backward(model: GLM5Model, micro: Sequence[TokenBatch], spec: StepSpec) -> StepSums:
    """``forward_backward`` on one pipeline stage: ``run_1f1b`` over the micro-batches, each
    through ``_stage_forward``; the sums are this stage's (the caller adds the stages')."""
    from .pipeline import run_1f1b

    sums = {"lm": torch.zeros(()), "indexer": torch.zeros(())}

    def stage_forward(i: int, streams: torch.Tensor | None):
        return _stage_forward(model, micro, spec, sums, i, streams)

    with _offload(spec.memory):  # the 1F1B schedule interleaves micro-batches: the whole step at once
        run_1f1b(model, len(micro), model.stream_shape(*micro[0].tokens.shape), stage_forward,
                 sync=lambda i: _deferred_sync(spec, last=i == len(micro) - 1))
    return StepSums(sums["lm"], sums["indexer"])


def _stage_forward(model: GLM5Model, micro: Sequence[TokenBatch], spec: StepSpec, sums: dict, i: int,
                   streams: torch.Tensor | None):
    """One pipeline stage's forward of micro-batch ``i`` (``pipeline.StageForward``): the
    streams for the next stage and this stage's loss term (its indexer losses; on the last stage
    the weighted cross-entropy too). Adds the detached parts to ``sums``."""
    batch = micro[i]
    tokens = batch.tokens.to(_device(model)) if model.pre_process else None
    out, losses = model.hidden(tokens, spec.mode, spec.indexer_tokens, streams=streams,
                               positions=batch.tokens.shape[1])
    if losses:
        sums["indexer"] += sum(loss.detach() for loss in losses).float().cpu() / len(micro)
    if not model.post_process:
        return out, spec.indexer_coeff * sum(losses) if losses else None
    parts = head_loss(model, out, batch, losses, spec)
    sums["lm"] += parts.lm_sum.float().cpu()
    return None, parts.total


def _deferred_sync(spec: StepSpec, last: bool):
    """Around one micro-batch's backward: ``spec.no_sync`` unless it is the step's last."""
    return spec.no_sync() if spec.no_sync is not None and not last else nullcontext()


def _offload(memory: MemoryConfig):
    return offload_saved_tensors(memory.offload_activations, memory.offload_pinned)


def _device(model: GLM5Model) -> torch.device:
    """Where the model's parameters are, and so where its inputs go."""
    return next(model.parameters()).device
