"""LoRA adapters on a frozen base (config section ``peft``), applied to a built model from outside.

Each targeted projection ``W`` (a megatron-core column- or row-parallel linear, a routed or shared
expert's, or a plain ``nn.Linear``) gets two small parameters on the same module,

    lora_a [r, in]    lora_b [out, r]    y = W x + (alpha / r) * lora_b (lora_a dropout(x))

added by a forward hook, so the base module, its name and its weight stay exactly as they were:
checkpoints, the Hugging Face key map, recompute and MoE chunking see the model they always saw.
``lora_b`` starts at zero, so a fresh adapter gives the base model's output bit for bit. Every
base parameter is frozen (``requires_grad`` off: no gradient buffer, no optimizer state) except
those ``peft.train`` names.

How the adapter is split follows its layer (the base's own split, so no layout changes a result):
- column-parallel (output features split over tensor parallel): ``lora_a`` whole on every rank,
  ``lora_b`` split by rows; the rank-``r`` activation enters the parallel region (identity
  forward, gradient summed over ranks backward);
- row-parallel (input features split, output summed): ``lora_a`` split by columns, its product
  summed over ranks (an ``r``-wide all-reduce), ``lora_b`` whole;
- the same two under sequence parallel (the MoE layer's shared expert with tp > 1): the column
  adapter's activation is gathered over the sequence, the row adapter's reduce-scattered, and the
  whole tensor that saw one slice of the sequence is marked ``sequence_parallel`` (its gradient
  summed over tensor parallel, as megatron-core's routers);
- routed experts (the dispatcher does their communication): no communication in the adapter;
  under expert tensor parallel the whole tensor whose gradient is partial per rank is marked
  ``expert_tp_partial`` and summed over that group after backward (``train.optim``);
- a GLU ``linear_fc1`` (``[gate; up]``, each rank holding its slice of both) keeps ``lora_b`` as
  ``[2, out / 2, r]`` split along dimension 1, the base weight's own layout.

Initialisation is by name: ``lora_a`` is drawn from a generator seeded by the parameter's name in
the whole model (layers numbered as in the whole model, experts by their global index) and this
rank takes its slice, so every layout starts from the same adapters.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from genome_lm.engine.layout import global_expert_name
from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.config import PeftConfig

    from .model import GLM5Model

# read as a raw weight by the absorbed MLA attention and the streaming prefill: a hook would miss it
NOT_TARGETS = ("kv_b_proj",)


@dataclass(frozen=True)
class _Split:
    """How one adapter is laid out and communicates (see the module docstring)."""

    kind: str  # "column", "row" or "replicated"
    group: object | None  # the tensor-parallel group of the base layer (None: replicated)
    sequence_parallel: bool  # the base layer gathers / reduce-scatters the sequence
    expert: bool  # a routed expert: no communication here
    glu: bool  # a [gate; up] fc1


def _split(name: str, module: nn.Module) -> _Split:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    expert = bool(getattr(module, "explicit_expert_comm", False)) or ".experts.local_experts." in name
    glu = name.endswith("linear_fc1")
    group = getattr(module, "tp_group", None)
    sp = bool(getattr(module, "sequence_parallel", False)) and group is not None and group.size() > 1
    te = type(module).__name__  # Transformer Engine's linears split the same way, returning the same tuple
    if isinstance(module, ColumnParallelLinear) or te.startswith(("TEColumnParallel", "TELayerNormColumnParallel")):
        return _Split("column", group, sp and not expert, expert, glu)
    if isinstance(module, RowParallelLinear) or te.startswith("TERowParallel"):
        return _Split("row", group, sp and not expert, expert, glu)
    if isinstance(module, nn.Linear):
        return _Split("replicated", None, False, False, False)
    raise GenomeLMError(f"peft.targets: {name} is a {type(module).__name__}, not a linear projection LoRA can adapt")


def _in_out(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of the whole layer, all tensor-parallel ranks together."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.input_size, module.output_size


def _generator(name: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _communication(split: _Split):
    """What the rank-r activation ``lora_a x`` goes through between ``lora_a`` and ``lora_b``
    (None: nothing, one rank or a routed expert): into the column layer's parallel region, or
    summed over the row layer's ranks; each in its sequence-parallel form where the layer has it."""
    if split.group is None or split.group.size() == 1 or split.expert or split.kind == "replicated":
        return None
    from megatron.core.tensor_parallel import mappings

    if split.kind == "column":
        op = (mappings.gather_from_sequence_parallel_region if split.sequence_parallel
              else mappings.copy_to_tensor_model_parallel_region)
    else:
        op = (mappings.reduce_scatter_to_sequence_parallel_region if split.sequence_parallel
              else mappings.reduce_from_tensor_model_parallel_region)
    return functools.partial(op, group=split.group)


class _Hook:
    """The forward hook that adds ``scale * lora_b (lora_a dropout(x))`` to a layer's output."""

    def __init__(self, split: _Split, scale: float, dropout: float):
        self.communicate, self.scale, self.dropout = _communication(split), scale, dropout

    def __call__(self, module: nn.Module, args, output):
        x = args[0]
        if self.dropout and module.training:
            x = nn.functional.dropout(x, self.dropout)
        a, b = module.lora_a, module.lora_b
        h = x @ a.to(x.dtype).t()
        if self.communicate is not None:
            h = self.communicate(h)
        delta = (h @ b.reshape(-1, b.shape[-1]).to(h.dtype).t()) * self.scale
        if isinstance(output, tuple):  # megatron-core's linears return (output, bias)
            return (output[0] + delta.to(output[0].dtype), *output[1:])
        return output + delta.to(output.dtype)


def _attach(model: GLM5Model, name: str, module: nn.Module, cfg: PeftConfig, seed: int) -> None:
    """Give ``module`` its adapter."""
    split = _split(name, module)
    n_in, n_out = _in_out(module)
    r = cfg.rank
    if r > min(n_in, n_out):
        raise GenomeLMError(f"peft.rank {r} is larger than {model.global_name(name)} ({n_out} x {n_in}): a rank "
                            f"of at most {min(n_in, n_out)} adapts it")
    weight = module.weight
    tp = split.group.size() if split.group is not None else 1
    tp_rank = split.group.rank() if split.group is not None else 0
    key = _whole_name(model, name)
    full_a = torch.empty(r, n_in).uniform_(-1 / math.sqrt(n_in), 1 / math.sqrt(n_in), generator=_generator(key, seed))
    dtype = weight.dtype
    if split.kind == "row":
        a = full_a.chunk(tp, dim=1)[tp_rank]
        b = torch.zeros(n_out, r)
    else:
        a = full_a
        local_out = n_out // tp if split.kind == "column" else n_out
        b = torch.zeros(2, local_out // 2, r) if split.glu else torch.zeros(local_out, r)
    module.lora_a = nn.Parameter(a.to(dtype).contiguous())
    module.lora_b = nn.Parameter(b.to(dtype).contiguous())
    split_one = module.lora_a if split.kind == "row" else module.lora_b  # the tensor split like the base
    if split.kind != "replicated" and tp > 1:
        split_one.tensor_model_parallel = True
        split_one.partition_dim = 1 if (split.kind == "row" or split.glu) else 0
        split_one.partition_stride = 1
    whole = module.lora_b if split.kind == "row" else module.lora_a
    if split.sequence_parallel:
        whole.sequence_parallel = True  # it saw this rank's slice of the sequence: summed over tp
    if split.expert and tp > 1:
        whole.expert_tp_partial = True  # its gradient is one expert-tensor-parallel rank's share
    for p in (module.lora_a, module.lora_b):
        p.allreduce = getattr(weight, "allreduce", True)  # routed experts: the expert data-parallel buffer
        if hasattr(weight, "sequence_parallel") and split.kind == "replicated":
            p.sequence_parallel = weight.sequence_parallel  # the DSA indexer's split selection
    module.lora_hook = module.register_forward_hook(_Hook(split, cfg.alpha / r, cfg.dropout))


def _whole_name(model: GLM5Model, name: str) -> str:
    """A module's or parameter's name with layers and routed experts numbered as in the whole
    model, whatever this rank's pipeline stage and expert-parallel share."""
    return global_expert_name(model.global_name(name), model.cfg.n_routed_experts, model.pg.ep)


def _matches(name: str, patterns) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def _require_every_pattern(model: GLM5Model, counts: dict[str, int], what: str) -> None:
    """A pattern that matches nothing on any rank is a mistake: refuse it (the counts are summed
    over every rank, so a layer one pipeline stage lacks, or an expert another expert-parallel
    rank holds, is not refused where it is absent)."""
    names = list(counts)
    total = torch.tensor([float(counts[n]) for n in names])
    if names and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    missing = [n for n, c in zip(names, total.tolist()) if c == 0]
    if missing:
        raise GenomeLMError(f"{what} {', '.join(repr(m) for m in missing)} matches no "
                            f"{'module' if what == 'peft.targets' else 'parameter'} of the model (names such as "
                            "layers.0.self_attention.q_proj, layers.1.mlp.experts.local_experts.0.linear_fc1)")


def apply_lora(model: GLM5Model, cfg: PeftConfig, seed: int = 0) -> None:
    """Freeze ``model``'s base (but the parameters ``cfg.train`` names) and give every module
    ``cfg.targets`` names (by its name in the whole model: layers and routed experts numbered as
    in one process, whatever the layout) a LoRA adapter. Call before the model
    is wrapped for data parallel (its gradient buffers are sized from ``requires_grad``)."""
    counts = {p: 0 for p in cfg.targets}
    chosen = []
    for name, module in model.named_modules():
        pattern = _matches(_whole_name(model, name), cfg.targets)
        if pattern is None:
            continue
        if name.rsplit(".", 1)[-1] in NOT_TARGETS:
            raise GenomeLMError(f"peft.targets: {model.global_name(name)} is read as a raw weight by the absorbed "
                                "attention path, which an adapter's hook does not see; leave it out")
        counts[pattern] += 1
        chosen.append((name, module))
    _require_every_pattern(model, counts, "peft.targets")
    trained = {p: 0 for p in cfg.train}
    routers_trained = False
    for name, p in model.named_parameters():
        pattern = _matches(_whole_name(model, name), cfg.train)
        if pattern is None:
            p.requires_grad_(False)
        else:
            trained[pattern] += 1
            routers_trained |= name.endswith("router.weight")
    _require_every_pattern(model, trained, "peft.train")
    if not routers_trained:  # a frozen router keeps its expert bias too (megatron-core skips it then)
        for module in model.modules():
            if hasattr(module, "expert_bias"):
                module.frozen_expert_bias = True
    for name, module in chosen:
        _attach(model, name, module, cfg, seed)
    model.peft = cfg  # checkpoints keep only what trains (checkpoint.sharded.model_tensors)


@torch.no_grad()
def merge_lora(model: GLM5Model) -> None:
    """Fold every adapter into its weight on this rank (``W + s B A`` of the local slices, which
    is this rank's slice of the whole merge under any split: see the module docstring) and remove
    the adapters and their hooks: the model is then a plain one, exported as any other."""
    cfg = getattr(model, "peft", None)
    if cfg is None:
        return
    for module in model.modules():
        if not hasattr(module, "lora_a"):
            continue
        weight = module.weight
        weight.copy_(merged_weight(weight, module.lora_a, module.lora_b, cfg.alpha / cfg.rank))
        module.lora_hook.remove()
        del module.lora_a, module.lora_b, module.lora_hook
    model.peft = None


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * B A`` for whole tensors (a GLU fc1's ``B`` as stored, ``[2, F, r]``:
    its halves in the weight's ``[gate; up]`` order), computed in fp32, in the weight's dtype."""
    delta = b.reshape(-1, b.shape[-1]).float() @ a.float()
    return (weight.float() + scale * delta).to(weight.dtype)

