"""Optimizer, learning-rate schedule and gradient norm.

On a GPU the optimizer is megatron-core's (``get_megatron_optimizer``: the distributed optimizer,
optional CPU offload of its state). On a CPU megatron-core's optimizers cannot run: they check
that every parameter is a ``torch.cuda.*Tensor`` and allocate their bookkeeping on 'cuda'. There
genome-lm steps torch's AdamW on megatron-core DDP's gradient buffers (``param.main_grad``),
with the gradient norm computed here the way megatron-core does: sharded parameters counted on
every rank, replicated ones once, then summed over the model-parallel groups.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def learning_rate(step: int, train) -> float:
    """lr at ``step`` (0-based) for a ``config.TrainConfig``: linear warm-up, then the schedule
    from lr down to min_lr at the last step."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return train.lr
    span = max(1, train.steps - train.warmup_steps - 1)
    progress = min(1.0, (step - train.warmup_steps) / span)
    if train.schedule == "linear":
        return train.lr + (train.min_lr - train.lr) * progress
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


def _is_expert(name: str) -> bool:
    return ".experts." in name


def grad_norm(named_params, pg) -> float:
    """Global L2 norm of the gradients (``main_grad`` when megatron-core DDP holds them)."""
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for name, p in named_params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is None:
            continue
        group = pg.expt_tp if _is_expert(name) else pg.tp
        if getattr(p, "tensor_model_parallel", False) or group.rank() == 0:
            sq = g.detach().double().square().sum().cpu()
            if _is_expert(name):
                expert += sq
            else:
                dense += sq
    if dist.is_initialized():
        if pg.tp.size() > 1:
            dist.all_reduce(dense, group=pg.tp)
        if pg.expt_tp.size() > 1:
            dist.all_reduce(expert, group=pg.expt_tp)
        if pg.ep.size() > 1:
            dist.all_reduce(expert, group=pg.ep)
    total = dense + expert
    if dist.is_initialized() and pg.pp.size() > 1:  # each pipeline stage holds its own layers
        dist.all_reduce(total, group=pg.pp)
    return math.sqrt(float(total))


class CPUAdamW:
    """torch AdamW over megatron-core DDP's fp32 gradient buffers, with global-norm clipping."""

    def __init__(self, ddp_model, train, pg):
        self.named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
        self.pg, self.clip = pg, train.grad_clip
        decay = [p for n, p in self.named if p.dim() > 1]
        no_decay = [p for n, p in self.named if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=1e-8)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def step(self) -> tuple[bool, float]:
        """Clip and step; returns (stepped, grad norm). A non-finite norm skips the update."""
        for _, p in self.named:
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad.to(p.dtype)
        norm = grad_norm(self.named, self.pg)
        if not math.isfinite(norm):
            return False, norm
        if self.clip and norm > self.clip:
            for _, p in self.named:
                if p.grad is not None:
                    p.grad.mul_(self.clip / (norm + 1e-6))
        self.optimizer.step()
        return True, norm

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)
