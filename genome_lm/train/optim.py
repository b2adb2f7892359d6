"""Optimizer, learning-rate schedule and gradient norm.

On a GPU the optimizer is megatron-core's (``get_megatron_optimizer``: the distributed optimizer,
optional CPU offload of its state). On a CPU megatron-core's optimizers cannot run: they check
that every parameter is a ``torch.cuda.*Tensor`` and allocate their bookkeeping on 'cuda'. There
genome-lm steps torch's AdamW on megatron-core DDP's gradient buffers (``param.main_grad``),
with the gradient norm computed here the way megatron-core does: sharded parameters counted on
every rank, replicated ones once, then summed over the model-parallel groups.
"""

from __future__ import annotations

import fnmatch
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from genome_lm.config import RunConfig
    from genome_lm.engine.backend import BackendProfile
    from genome_lm.model.model import GLM5Model


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


def grad_norm(named_params, pg: ProcessGroupCollection) -> float:
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

    def __init__(self, ddp_model, train, pg: ProcessGroupCollection):
        self.named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
        self.pg, self.clip = pg, train.grad_clip
        scales = lr_scales(self.named, train.lr_scale, ddp_model.module)
        groups = []
        for scale in sorted(set(scales.values()) | {1.0}, key=lambda x: (x != 1.0, -x)):  # 1.0 first, as before
            decay = [p for n, p in self.named if scales[n] == scale and p.dim() > 1]
            no_decay = [p for n, p in self.named if scales[n] == scale and p.dim() <= 1]
            groups += [{"params": params, "weight_decay": wd, "lr_scale": scale}
                       for params, wd in ((decay, train.weight_decay), (no_decay, 0.0)) if params or scale == 1.0]
        self.optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=1e-8)

    def set_lr(self, lr: float) -> None:
        """The schedule's rate, times each group's ``train.lr_scale`` multiplier."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]

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

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The per-parameter optimizer inside: checkpoints store its state in pieces that any
        parallel layout can load (``checkpoint.sharded``)."""
        return self.optimizer

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


def lr_scales(named, patterns: dict[str, float], model: GLM5Model | None = None) -> dict[str, float]:
    """Each parameter's learning-rate multiplier: the first of ``patterns`` (``train.lr_scale``:
    shell-style globs over parameter names, in order) that matches its name, else 1. Names are
    the whole model's (``model``'s layers and routed experts numbered as in one process, whatever
    its pipeline stage and expert-parallel share), so a pattern means the same tensors on every
    layout. A pattern that matches no parameter on any rank is an error (a typo would otherwise
    silently train everything)."""
    from genome_lm.model.peft import _require_every_pattern, _whole_name

    counts = dict.fromkeys(patterns, 0)
    out = {}
    for name, _ in named:
        whole = _whole_name(model, name) if model is not None else name
        pattern = next((pattern for pattern in patterns if fnmatch.fnmatchcase(whole, pattern)), None)
        out[name] = 1.0 if pattern is None else patterns[pattern]
        for p in patterns:
            counts[p] += fnmatch.fnmatchcase(whole, p)
    if model is not None:
        _require_every_pattern(model, counts, "train.lr_scale")
    elif unused := [p for p, n in counts.items() if n == 0]:
        raise GenomeLMError(f"train.lr_scale: {unused[0]!r} matches no parameter")
    return out


def allreduce_sequence_parallel_grads(model: GLM5Model) -> None:
    """Sum over tensor-parallel ranks the gradients of replicated parameters that saw only this
    rank's tokens (megatron-core marks them ``sequence_parallel``: the MoE routers), and over
    expert-tensor-parallel ranks those of the routed experts' whole LoRA tensors, whose gradient
    is one rank's share (``expert_tp_partial``, model.peft). Call after backward, before the
    optimizer; a no-op without tensor parallel."""
    for group, mark in ((model.pg.tp, "sequence_parallel"), (model.pg.expt_tp, "expert_tp_partial")):
        if group is None or group.size() == 1:
            continue
        for p in model.parameters():
            if getattr(p, mark, False) and p.requires_grad:
                grad = getattr(p, "main_grad", None)
                grad = p.grad if grad is None else grad
                if grad is not None:
                    torch.distributed.all_reduce(grad, group=group)


# ------------------------------------------------------------------ the optimizer the loop steps
def make_optimizer(cfg: RunConfig, ddp, pg: ProcessGroupCollection, backend: BackendProfile):
    """The run's optimizer behind the loop's small interface (``set_lr``, ``zero_grad``, ``step``,
    state dicts): genome-lm's CPUAdamW on the CPU profile, megatron-core's distributed optimizer
    on the GPU one."""
    if not backend.distributed_optimizer:
        return CPUAdamW(ddp, cfg.train, pg)
    if cfg.train.lr_scale:
        raise GenomeLMError("train.lr_scale: only the CPU optimizer applies per-parameter learning rates "
                            "(megatron-core's optimizer groups the parameters its own way)")
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(**megatron_optimizer_options(cfg, ddp.module.options.dtype)),
                                       [ddp], pg_collection=pg, use_gloo_process_groups=False)
    apply_weight_decay_multipliers(optimizer.param_groups, cfg.train.weight_decay)
    return MegatronOptimizer(optimizer)


def megatron_optimizer_options(cfg: RunConfig, params_dtype: torch.dtype) -> dict:
    """megatron-core's ``OptimizerConfig`` fields for a run (GPU path):

    - ``loss_scale=1.0``: a constant grad scaler, the only way megatron-core's optimizer checks
      the gradients for inf/NaN (across ranks) when training in bf16; without one it clips with
      a NaN norm (which scales nothing) and applies the step;
    - ``use_precision_aware_optimizer`` with ``optimizer_cpu_offload``: the hybrid CPU/GPU
      optimizer reuses that path, and without it the fp32 main parameters stay on the GPU
      (Megatron-LM refuses the combination)."""
    t = cfg.train
    offload = cfg.memory.optimizer_offload
    return dict(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                adam_beta2=t.adam_beta2, clip_grad=t.grad_clip, bf16=cfg.model.dtype == "bf16",
                params_dtype=params_dtype, loss_scale=1.0, use_distributed_optimizer=True,
                optimizer_cpu_offload=offload, use_precision_aware_optimizer=offload)


def apply_weight_decay_multipliers(param_groups, weight_decay: float) -> None:
    """Each group's weight decay from megatron-core's ``wd_mult`` (0 for 1-D parameters and
    biases): megatron-core leaves that to its ``OptimizerParamScheduler``, which genome-lm does
    not use (it sets the learning rate itself), so without this every parameter, norms and
    KDA's ``A_log``/``dt_bias`` included, would decay. The CPU optimizer follows the same rule."""
    for group in param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


class MegatronOptimizer:
    """megatron-core's optimizer behind the small interface the loop uses (GPU path)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float]:
        ok, norm, _ = self.optimizer.step()
        return bool(ok), float(norm) if norm is not None else float("nan")

    def state_dict(self):
        """megatron-core's optimizer state and, for each distributed optimizer in it, this rank's
        shard of the fp32 main parameters and Adam moments: ``DistributedOptimizer.state_dict()``
        leaves those out (megatron-core saves them apart), and without them a resumed run would
        restart Adam. Tensors, numbers and dtypes only: it loads with ``weights_only=True``.

        Before the first update Adam has no state yet (every step so far was skipped), and
        megatron-core can neither save nor reload that: the checkpoint then says so, and a resume
        starts the optimizer afresh, which is what it is."""
        inner = _inner_optimizers(self.optimizer)
        if not any(len(getattr(o, "state", {})) for o in inner):
            return {"optimizer": None, "param_state": [None] * len(inner), "no_step_yet": True}
        return {"optimizer": self.optimizer.state_dict(), "param_state": [_param_state(o) for o in inner]}

    def load_state_dict(self, state):
        if state.get("no_step_yet"):
            return
        inner = _inner_optimizers(self.optimizer)
        if len(state["param_state"]) != len(inner):
            raise GenomeLMError(f"the checkpoint's optimizer has {len(state['param_state'])} parts, this run's "
                                f"{len(inner)}: resume with the parallel layout it was saved with")
        self.optimizer.load_state_dict(state["optimizer"])
        for optimizer, shard in zip(inner, state["param_state"]):
            if shard is not None:
                optimizer.load_parameter_state_from_dp_reshardable(shard)


def _inner_optimizers(optimizer) -> list:
    """The optimizers inside megatron-core's ``ChainedOptimizer`` (dense and expert parameters),
    or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _param_state(optimizer):
    """A distributed optimizer's shard of main parameters and optimizer states, in megatron-core's
    own per-bucket layout (``get_parameter_state_dp_reshardable``); None for other optimizers.
    Its loader skips entries flagged as padding, a flag its getter does not set: set it."""
    if not hasattr(optimizer, "get_parameter_state_dp_reshardable"):
        return None
    state = optimizer.get_parameter_state_dp_reshardable()
    for key, by_dtype in state.items():
        if isinstance(key, int):  # one grad buffer: {dtype: [bucket: [per-parameter dict]]}
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for tensors in bucket:
                        tensors.setdefault("padding", False)
    return state
