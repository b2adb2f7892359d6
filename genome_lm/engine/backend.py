"""The run's backend profile: every choice that differs between the GPU path and the CPU path,
made once, in one place.

    gpu  nccl process groups, Transformer Engine specs (when installed), the all-to-all MoE
         dispatcher, batched pipeline send/recv, megatron-core's distributed optimizer,
         the GPU kernel backend (genome_lm_kernels' Triton kernels), pinned host memory
    cpu  gloo process groups, megatron-core's local (torch) specs, the all-gather MoE dispatcher,
         one send/recv at a time (gloo has no batched p2p), genome-lm's CPUAdamW over the same
         parameter groups, the chunked torch kernels, parameters initialised on the CPU

``current()`` is the profile of this process (a GPU when torch sees one); ``profile(gpu=...)``
gives either profile as values without needing the hardware, so both are tested on a CPU. The
trainer prints ``describe()`` at start-up and logs it to MLflow.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genome_lm_kernels import KernelBackend


@dataclass(frozen=True)
class BackendProfile:
    gpu: bool
    device: str  # torch device type: "cuda" or "cpu"
    process_groups: str  # torch.distributed backend: "nccl" or "gloo"
    transformer_impl: str  # megatron-core spec provider: "transformer_engine" or "local"
    moe_dispatcher: str  # megatron-core token dispatcher: "alltoall" or "allgather"
    batch_p2p: bool  # pipeline stages exchange activations with batched isend/irecv
    optimizer: str  # "megatron-distributed" (megatron-core's, ZeRO-1) or "cpu-adamw" (genome-lm's)
    kernel_backend: KernelBackend  # what model.kernel_backend "auto" becomes: "triton" or "torch"
    cpu_initialization: bool  # megatron-core initialises parameters on the CPU
    pinned_host_memory: bool  # offloaded activations go to pinned (page-locked) host memory

    @property
    def name(self) -> str:
        return "gpu" if self.gpu else "cpu"

    @property
    def distributed_optimizer(self) -> bool:
        return self.optimizer == "megatron-distributed"

    def resolve_impl(self, transformer_impl: str) -> str:
        """A config's ``model.transformer_impl`` ("auto", "local", "transformer_engine")."""
        return self.transformer_impl if transformer_impl == "auto" else transformer_impl

    def describe(self) -> str:
        return (f"backend: {self.name} ({self.process_groups} process groups, {self.transformer_impl} specs, "
                f"{self.moe_dispatcher} MoE dispatcher, {self.optimizer} optimizer, kernels: {self.kernel_backend})")

    def as_params(self) -> dict[str, str]:
        """The profile as MLflow parameters (``backend.*``)."""
        return {"backend.profile": self.name, "backend.process_groups": self.process_groups,
                "backend.transformer_impl": self.transformer_impl, "backend.moe_dispatcher": self.moe_dispatcher,
                "backend.optimizer": self.optimizer, "backend.kernels": str(self.kernel_backend)}


def profile(*, gpu: bool, transformer_engine: bool | None = None) -> BackendProfile:
    """The GPU or CPU profile. ``transformer_engine``: whether Transformer Engine is installed
    (default: look); without it a GPU uses megatron-core's local specs."""
    from genome_lm_kernels import resolve_backend

    if not gpu:
        return BackendProfile(gpu=False, device="cpu", process_groups="gloo", transformer_impl="local",
                              moe_dispatcher="allgather", batch_p2p=False, optimizer="cpu-adamw",
                              kernel_backend=resolve_backend("auto", "cpu"), cpu_initialization=True,
                              pinned_host_memory=False)
    te = has_transformer_engine() if transformer_engine is None else transformer_engine
    return BackendProfile(gpu=True, device="cuda", process_groups="nccl",
                          transformer_impl="transformer_engine" if te else "local", moe_dispatcher="alltoall",
                          batch_p2p=True, optimizer="megatron-distributed",
                          kernel_backend=resolve_backend("auto", "cuda"),
                          cpu_initialization=False, pinned_host_memory=True)


@functools.cache
def current() -> BackendProfile:
    """This process's profile: the GPU one when torch sees a CUDA device."""
    import torch

    return profile(gpu=torch.cuda.is_available())


def on_gpu() -> bool:
    """This process runs the GPU profile."""
    return current().gpu


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
