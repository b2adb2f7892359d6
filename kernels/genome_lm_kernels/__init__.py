"""genome-lm's sequence ops (imported as ``genome_lm_kernels``).

One folder per op, each with a readable reference, a CPU-efficient torch path and a Triton GPU
path that share one signature. The caller picks the path with an explicit ``backend``
argument, resolved once; nothing here reads a global setting.
"""

from typing import Literal

import torch

Backend = Literal["reference", "torch", "triton", "triton-fp32", "fla"]
BACKENDS = ("reference", "torch", "triton", "triton-fp32", "fla")
# "triton": tensor-core kernels (bf16 operands, fp32 accumulation and state); "triton-fp32": the
# same kernels with every product in fp32 (parity tests); "fla": fla-core's chunk_kda for KDA
# (GPU only; the DSA ops then run their Triton kernels).
GPU_BACKENDS = ("triton", "triton-fp32", "fla")


def resolve_backend(name: str, device: torch.device | str) -> Backend:
    """Turn a user's choice (``"auto"`` or a backend name) into a backend, once.

    ``auto`` means the GPU default on a CUDA device (``gpu_default``) and the chunked torch path
    elsewhere. Asking for Triton on a CPU tensor is allowed only under ``TRITON_INTERPRET=1``
    (tests do that); fla-core's kernels do not run under the interpreter, so "fla" needs a GPU.
    """
    import os

    device = torch.device(device)
    if name == "auto":
        return gpu_default() if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    if name == "fla" and device.type != "cuda":
        raise ValueError("the fla backend needs a CUDA device (fla-core's Triton kernels do not run on a CPU)")
    if name in GPU_BACKENDS and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the {name} backend needs a CUDA device (or TRITON_INTERPRET=1 for CPU tests)")
    return name  # type: ignore[return-value]


def gpu_default() -> Backend:
    """The backend "auto" picks on a GPU: genome_lm_kernels' own Triton kernels. This is the
    fallback, not a measurement: ``genome-lm preflight`` times them against fla-core's chunk_kda
    on the GPU at hand and prints the faster as ``model.kernel_backend`` (no GPU has run them yet
    as of this writing; see the README's GPU section)."""
    return "triton"
