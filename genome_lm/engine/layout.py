"""Where a parameter's pieces live across ranks, and moving them: the collectives that load and
export whole tensors under any tensor, expert and pipeline parallel layout.

- tensor parallel: a rank holds a slice of the full tensor along ``param.partition_dim`` in its
  tensor (or expert-tensor) parallel group; a GLU ``linear_fc1`` (``[gate; up]``) is sliced as
  ``[gate_r; up_r]`` (``glu=True``);
- expert parallel: rank ``r`` of the expert group holds experts ``r * local .. (r + 1) * local - 1``;
- pipeline parallel: each stage holds its layers; ``to_rank0`` brings every stage's tensors to
  global rank 0, one at a time.

Model-format code (``checkpoint.huggingface``) names the tensors; this module only moves them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist


def _split(param: torch.Tensor, group) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and group is not None and group.size() > 1


def tp_slice(full: torch.Tensor, param: torch.Tensor, group, *, glu: bool = False) -> torch.Tensor:
    """This rank's slice of ``full`` for ``param`` (``full`` itself when ``param`` is not split)."""
    if not _split(param, group):
        return full
    dim, rank, size = param.partition_dim, group.rank(), group.size()
    if glu:
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(size, dim=dim)[rank]


def tp_gather(local: torch.Tensor, param: torch.Tensor, group, *, glu: bool = False) -> torch.Tensor:
    """The full tensor from every rank's slice (collective over ``group``; the inverse of ``tp_slice``)."""
    if not _split(param, group):
        return local
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    if glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


def ep_gather(local: torch.Tensor, group) -> list[torch.Tensor]:
    """Every expert-parallel rank's tensor, in rank order (collective over ``group``)."""
    if group is None or group.size() == 1:
        return [local]
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    return parts


def expert_offset(n_experts: int, group) -> int:
    """The global index of this rank's first local expert."""
    if group is None:
        return 0
    return group.rank() * (n_experts // group.size())


_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def global_expert_name(name: str, n_experts: int, group) -> str:
    """``name`` with a routed expert's local index (``local_experts.<j>.``) replaced by its index
    in the whole model under expert parallel ``group``; any other name as it is."""
    if group is None or group.size() == 1 or not (m := _LOCAL_EXPERT.search(name)):
        return name
    return name[:m.start()] + f"local_experts.{expert_offset(n_experts, group) + int(m.group(1))}." + name[m.end():]


def to_rank0(items: Iterable[tuple[str, torch.Tensor]], pp) -> Iterator[tuple[str, torch.Tensor]]:
    """Global rank 0 gets ``(key, tensor)`` of every pipeline stage: its own ``items``, then each
    later stage's, sent by the rank of that stage at rank 0's coordinates. Call on every rank
    (every rank iterates ``items``, which may be collective within a stage); only rank 0 yields."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    stages = pp.size() if pp is not None else 1
    sender = stages > 1 and pp.rank() > 0 and dist.get_global_rank(pp, 0) == 0
    for key, tensor in items:
        if rank0:
            yield key, tensor
        elif sender:
            dist.send_object_list([(key, tuple(tensor.shape), tensor.dtype)], dst=0)
            dist.send(tensor.contiguous(), dst=0)
    if sender:
        dist.send_object_list([None], dst=0)
    if rank0 and stages > 1:
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"  # NCCL: GPU only
        for stage in range(1, stages):
            src = dist.get_global_rank(pp, stage)
            while True:
                meta = [None]
                dist.recv_object_list(meta, src=src)
                if meta[0] is None:
                    break
                key, shape, dtype = meta[0]
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(tensor, src=src)
                yield key, tensor.cpu()
