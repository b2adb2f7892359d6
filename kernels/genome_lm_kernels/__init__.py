"""genome-lm's sequence ops (imported as ``genome_lm_kernels``).

One folder per op, each with a readable reference, a CPU-efficient torch path and a Triton GPU
path that share one signature. ``resolve_backend`` is the one place that turns a backend name
into a ``KernelBackend``; every public op takes that resolved object (a plain name is refused),
so no op resolves, remaps or lists names of its own. Whether the torch path runs the C kernels
(``cpu/native.py``) is resolved there too (``KernelBackend.native``), and the one global setting
read is ``GENOME_LM_NATIVE=0`` (C off), by ``resolve_backend`` only (and Triton's own
``TRITON_INTERPRET=1``, under which ``interpreter.py`` skips repeated work).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

Backend = Literal["reference", "torch", "triton", "triton-fp32", "fla"]
BACKENDS = ("reference", "torch", "triton", "triton-fp32", "fla")
# "triton": tensor-core kernels (half-precision operands, fp32 accumulation and state);
# "triton-fp32": the same kernels with every product in fp32 (parity tests); "fla": fla-core's
# chunk_kda for KDA (GPU only; the DSA ops then run their Triton kernels).
GPU_BACKENDS = ("triton", "triton-fp32", "fla")


@dataclass(frozen=True, eq=False)
class KernelBackend:
    """A resolved kernel backend: the name chosen and what each op runs under it. Made only by
    ``resolve_backend``, which has checked it against the device."""

    name: Backend
    device: str  # torch device type it was resolved for: "cuda" or "cpu"
    native: bool = False  # the torch path runs genome-lm's C kernels where they take the inputs (cpu/native.py)

    @property
    def kda(self) -> Literal["reference", "torch", "triton", "fla"]:
        """KDA's path: the token loop, the chunked torch path, the Triton kernels or fla-core's."""
        return "triton" if self.name == "triton-fp32" else self.name  # type: ignore[return-value]

    @property
    def dsa(self) -> Literal["reference", "torch", "triton"]:
        """The DSA ops' path: every GPU backend runs genome-lm's own DSA Triton kernels."""
        return "triton" if self.gpu else self.name  # type: ignore[return-value]

    @property
    def exact(self) -> bool:
        """The Triton kernels compute every product in fp32 (``triton-fp32``, for parity checks)."""
        return self.name == "triton-fp32"

    @property
    def gpu(self) -> bool:
        """A GPU kernel path (Triton or fla-core; on a CPU only under ``TRITON_INTERPRET=1``)."""
        return self.name in GPU_BACKENDS

    def __str__(self) -> str:
        if not self.native:
            return self.name
        from .cpu import native

        return f"{self.name} with C kernels ({native.level()} build)"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):  # a name compared with a resolved backend is a bug, not False
            raise TypeError(f"compare a backend's .name (or .kda, .dsa, .gpu) with {other!r}, not the backend")
        if not isinstance(other, KernelBackend):
            return NotImplemented
        return (self.name, self.device, self.native) == (other.name, other.device, other.native)

    def __hash__(self) -> int:
        return hash((self.name, self.device, self.native))


def native_wanted() -> bool:
    """``GENOME_LM_NATIVE`` (default on): the C kernels may run. Read by ``resolve_backend`` only."""
    return os.environ.get("GENOME_LM_NATIVE", "1").lower() not in ("0", "false", "no", "off")


def resolve_backend(name: str | KernelBackend, device: torch.device | str, *, native: bool | None = None
                    ) -> KernelBackend:
    """Turn a user's choice (``"auto"`` or a backend name) into a backend, once.

    ``auto`` means the GPU default on a CUDA device (``gpu_default``) and the chunked torch path
    elsewhere. Asking for Triton on a CPU tensor is allowed only under ``TRITON_INTERPRET=1``
    (tests do that); fla-core's kernels do not run under the interpreter, so "fla" needs a GPU.
    ``native``: whether the torch path on a CPU runs genome-lm's C kernels (KDA, DSA, mHC) where
    they take the inputs; None = when they are built in this install and ``GENOME_LM_NATIVE`` is
    not 0; True = they must (RuntimeError when they are not built); False = torch ops only. Every
    other backend runs no C ("reference" is the reference everywhere).
    An already resolved backend is checked against ``device`` and returned.
    """
    device = torch.device(device)
    if isinstance(name, KernelBackend):
        if native is None and name.device == device.type:
            native = name.native
        name = name.name
    if name == "auto":
        name = gpu_default() if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    if name == "fla" and device.type != "cuda":
        raise ValueError("the fla backend needs a CUDA device (fla-core's Triton kernels do not run on a CPU)")
    if name in GPU_BACKENDS and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the {name} backend needs a CUDA device (or TRITON_INTERPRET=1 for CPU tests)")
    from .cpu import native as c_kernels

    takes_c = name == "torch" and device.type == "cpu"
    if native and not takes_c:
        raise ValueError(f"the C kernels run on the torch backend on a CPU only, not {name} on {device.type}")
    if native and not c_kernels.available():
        raise RuntimeError(c_kernels.NOT_BUILT)
    if native is None:
        native = takes_c and native_wanted() and c_kernels.available()
    return KernelBackend(name=name, device=device.type, native=bool(native))  # type: ignore[arg-type]


def resolved(backend, op: str) -> KernelBackend:
    """``backend`` if it is resolved; else a TypeError saying how to resolve it (ops call this)."""
    if not isinstance(backend, KernelBackend):
        raise TypeError(f"{op}() takes a resolved backend, not {backend!r}: pass "
                        f"genome_lm_kernels.resolve_backend({str(backend)!r}, device)")
    return backend


def gpu_default() -> Backend:
    """The backend "auto" picks on a GPU: genome_lm_kernels' own Triton kernels. This is the
    fallback, not a measurement: ``genome-lm preflight`` times them against fla-core's chunk_kda
    on the GPU at hand and prints the faster as ``model.kernel_backend`` (no GPU has run them yet
    as of this writing; see docs/gpu.md)."""
    return "triton"
