"""genome-lm's sequence ops (imported as ``genome_lm_kernels``).

One folder per op, each with a readable reference, a CPU-efficient torch path and a Triton GPU
path that share one signature. The caller picks the path with an explicit ``backend``
argument, resolved once; nothing here reads a global setting.
"""

from typing import Literal

import torch

Backend = Literal["reference", "torch", "triton"]
BACKENDS = ("reference", "torch", "triton")


def resolve_backend(name: str, device: torch.device | str) -> Backend:
    """Turn a user's choice (``"auto"`` or a backend name) into a backend, once.

    ``auto`` means Triton on a CUDA device and the chunked torch path elsewhere. Asking for
    Triton on a CPU tensor is allowed only under ``TRITON_INTERPRET=1`` (tests do that).
    """
    import os

    device = torch.device(device)
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for CPU tests)")
    return name  # type: ignore[return-value]
