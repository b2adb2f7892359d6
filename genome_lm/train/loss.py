"""The training loss: weighted next-token cross-entropy over a vocabulary split across
tensor-parallel ranks, plus the auxiliary losses, each reported apart.

Weights come from the data loader: 0 where the target is N or missing, ``softmask_weight`` where
the target base is soft-masked, 1 elsewhere. The loss of a step is sum(w * ce) / sum(w) over all
tokens of the global batch, so every rank divides by the same global weight (all-reduced over
the data- and context-parallel ranks), and summing the ranks' gradients gives the gradient of
the global mean.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class LossParts(NamedTuple):
    total: torch.Tensor  # what backward() runs on
    lm: torch.Tensor  # weighted cross-entropy, this rank's share of the global mean
    lm_sum: torch.Tensor  # sum(w * ce) on this rank (detached)
    weight_sum: torch.Tensor  # sum(w) on this rank
    indexer: torch.Tensor  # sum of the DSA indexer losses (detached)


def token_cross_entropy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token cross-entropy [B, T] in fp32; ``logits`` is this rank's vocabulary shard."""
    if tp_group is not None and tp_group.size() > 1:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits_BTV.float(), labels_BT, tp_group=tp_group)
    return torch.nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(),
                                             reduction="none").view_as(labels_BT)


def lm_loss(logits_BTV, labels_BT, weights_BT, *, global_weight: torch.Tensor, indexer_losses=(),
            indexer_coeff: float = 1.0, tp_group=None) -> LossParts:
    """``global_weight`` is sum(w) over the whole global batch (every rank passes the same)."""
    ce = token_cross_entropy(logits_BTV, labels_BT.clamp_min(0), tp_group)
    w = weights_BT.float()
    return _loss_parts((ce * w).sum(), w, global_weight, indexer_losses, indexer_coeff)


def _loss_parts(lm_sum, w, global_weight, indexer_losses, indexer_coeff) -> LossParts:
    """The parts from sum(w * ce) over this rank's tokens and the indexer losses."""
    lm = lm_sum / global_weight.clamp_min(1e-12)
    indexer = sum(indexer_losses) if indexer_losses else torch.zeros((), device=lm.device)
    total = lm + indexer_coeff * indexer
    return LossParts(total, lm, lm_sum.detach(), w.sum(), indexer.detach() if torch.is_tensor(indexer) else indexer)


def global_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over ``group`` (None: every rank); identity without a process group. The
    result is on ``value``'s device; the reduction runs where the group's backend can (NCCL
    reduces GPU tensors only, so a CPU value goes through the current GPU)."""
    value = value.detach().float()
    if not (dist.is_initialized() and (group is None or group.size() > 1)):
        return value.clone()
    device = value.device
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    reduced = value.to(device, copy=True)
    dist.all_reduce(reduced, group=group)
    return reduced.to(value.device)


def _block_ce(output_layer, h_SBD, labels_BT, tp_group):
    logits = output_layer(h_SBD)[0].transpose(0, 1)  # [B, S, V / tp]
    return token_cross_entropy(logits, labels_BT.clamp_min(0), tp_group)


def chunked_lm_loss(output_layer, h_SBD, labels_BT, weights_BT, *, global_weight: torch.Tensor, chunk: int,
                    indexer_losses=(), indexer_coeff: float = 1.0, tp_group=None) -> LossParts:
    """``lm_loss`` of ``output_layer(h)`` computed ``chunk`` positions at a time: each block's
    logits (and their fp32 copies and softmax) exist only while it is scored and are recomputed
    in backward, so the loss holds [chunk, V / tp] instead of [T, V / tp] (over a 154,880-entry
    vocabulary that is the largest activation of a long window)."""
    from torch.utils.checkpoint import checkpoint

    S = h_SBD.shape[0]
    w = weights_BT.float()
    lm_sum = h_SBD.new_zeros((), dtype=torch.float32)
    for s0 in range(0, S, chunk):
        s1 = min(s0 + chunk, S)
        ce = checkpoint(_block_ce, output_layer, h_SBD[s0:s1], labels_BT[:, s0:s1], tp_group, use_reentrant=False)
        lm_sum = lm_sum + (ce * w[:, s0:s1]).sum()
    return _loss_parts(lm_sum, w, global_weight, indexer_losses, indexer_coeff)
