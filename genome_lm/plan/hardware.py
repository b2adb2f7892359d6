"""GPUs the planner knows by name (``engine.devices.SPECS``), and reading ``--gpu`` / ``--gpu-mem``."""

from __future__ import annotations

from genome_lm.engine.devices import SPECS, GPUSpec
from genome_lm.errors import GenomeLMError


def gpu_spec(name: str) -> GPUSpec:
    """The GPU kind ``--gpu NAME`` names (any case)."""
    try:
        return SPECS[name.upper()]
    except KeyError:
        raise GenomeLMError(f"--gpu {name}: unknown GPU (known: {', '.join(SPECS)}; or give --gpu-mem GB)") from None


def gpu_memory(name: str, override_gb: float | None = None) -> tuple[str, float]:
    """(label, bytes) for ``--gpu NAME`` or ``--gpu-mem GB`` (which wins)."""
    if override_gb is not None:
        if override_gb <= 0:
            raise GenomeLMError(f"--gpu-mem {override_gb}: must be positive (GB)")
        return f"{override_gb:g} GB", override_gb * 1e9
    spec = gpu_spec(name)
    return spec.name, spec.memory
