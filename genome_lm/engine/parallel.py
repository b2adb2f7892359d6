"""Process groups: the one place genome-lm touches torch.distributed and megatron-core's
``parallel_state`` globals.

``parallel_context(sizes)`` initialises the default process group if nobody has (a one-process
group on a free local port: the CPU demo and the tests), sets up megatron-core's tensor /
context / expert / pipeline groups, and yields the ``ProcessGroupCollection`` that every model
module receives explicitly. On exit it destroys the groups it created (and the default group,
when it started it), so one process can build models with different layouts, many times over.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from genome_lm.errors import GenomeLMError

from .allocator import use_heap
from .backend import current, on_gpu
from .cpu import enable_cpu_megatron


@dataclass(frozen=True)
class ParallelSizes:
    """How the model is split: tensor, context, expert, expert-tensor and pipeline parallel, and
    whether the residual streams run sequence-parallel over the tensor-parallel ranks."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    sequence_parallel: bool = False  # residual streams split over the TP ranks (genome_lm.model.model)
    split_dsa_selection: bool = True  # DSA selection and indexer loss shared out over TP x CP (model.dsa)
    moe_shared_expert_overlap: bool = False  # megatron-core's MoE layer runs the shared expert under its all-to-alls

    @classmethod
    def of(cls, parallel) -> "ParallelSizes":
        """The sizes of a config's ``parallel`` section (``config.ParallelConfig``)."""
        p = parallel
        return cls(tp=p.tp, cp=p.cp, ep=p.ep, etp=p.etp, pp=p.pp, sequence_parallel=p.sequence_parallel,
                   split_dsa_selection=p.split_dsa_selection, moe_shared_expert_overlap=p.moe_shared_expert_overlap)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pp

    def check(self, world_size: int) -> None:
        if world_size % self.model_parallel:
            raise GenomeLMError(f"world size {world_size} is not a multiple of tp*cp*pp = {self.model_parallel} "
                                "(start that many ranks: torchrun --nproc-per-node, or --workers on Ray)")
        if world_size % (self.ep * self.etp * self.pp):
            raise GenomeLMError(f"world size {world_size} is not a multiple of ep*etp*pp = "
                                f"{self.ep * self.etp * self.pp}")


def check_stated_gpus(stated: int | None, world_size: int) -> None:
    """A config that states its GPU count (``parallel.gpus``) runs on that many ranks: on another
    number the data-parallel size would change, and with it the batch split and the plan."""
    if stated is not None and stated != world_size:
        ranks = "rank" if world_size == 1 else "ranks"
        raise GenomeLMError(f"parallel.gpus is {stated} but the job has {world_size} {ranks} (start {stated}, or "
                            "--set parallel.gpus=null to run on these)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int | None = None, world_size: int | None = None, *,
                     init_method: str | None = None) -> None:
    """Start the default process group (gloo on CPU, nccl on GPU) unless one exists. Under
    torchrun (MASTER_ADDR, RANK, WORLD_SIZE in the environment) rank and size come from there."""
    if dist.is_initialized():
        return

    profile = current()
    if init_method is None and "MASTER_ADDR" in os.environ:
        init_method = "env://"
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if init_method is None:
        if world_size != 1:
            raise ValueError("a multi-process group needs init_method or MASTER_ADDR/MASTER_PORT")
        init_method = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group(profile.process_groups, init_method=init_method, rank=rank, world_size=world_size)
    if profile.gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))


@contextmanager
def parallel_context(sizes: ParallelSizes = ParallelSizes(), *,
                     host_heap: str = "keep") -> Iterator["ProcessGroupCollection"]:  # noqa: F821
    """Yield megatron-core's process groups for ``sizes``; tear them down afterwards. On a CPU,
    ``host_heap`` ("keep", "return"; "auto" unresolved keeps) is set first, before anything is
    allocated (``engine.allocator.use_heap``)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    enable_cpu_megatron()  # no-op on a GPU machine
    if not on_gpu():
        use_heap(host_heap)  # CPU tensors: large temporaries reuse the heap, or go back (engine.allocator)
    started_here = not dist.is_initialized()
    init_distributed()
    before = _process_groups()
    try:
        sizes.check(dist.get_world_size())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            context_parallel_size=sizes.cp,
            expert_model_parallel_size=sizes.ep,
            expert_tensor_parallel_size=sizes.etp,
        )
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        parallel_state.destroy_model_parallel()
        # megatron-core forgets its groups but does not destroy them: each gloo group keeps two
        # threads and a socket alive, so a process that builds many models (a notebook, the
        # tests) would pile them up. Destroy what this context created.
        if started_here:
            dist.destroy_process_group()  # the default group and every group made under it
        else:
            for group in _process_groups() - before:
                dist.destroy_process_group(group)


def _process_groups() -> set:
    """Every process group of this process. torch keeps the registry private: should it move,
    this returns nothing (groups are left as before, and tests/engine/test_parallel_context.py
    fails) rather than break every model build."""
    from torch.distributed import distributed_c10d

    return set(getattr(getattr(distributed_c10d, "_world", None), "pg_map", {}))
