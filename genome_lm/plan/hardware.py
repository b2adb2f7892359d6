"""GPUs the planner knows by name, and reading ``--gpu`` / ``--gpu-mem``."""

from __future__ import annotations

from genome_lm.errors import GenomeLMError

# usable HBM per GPU as the vendors state it, in bytes (decimal GB)
GPUS: dict[str, float] = {"B200": 180e9, "H200": 141e9, "H100": 80e9}


def gpu_memory(name: str, override_gb: float | None = None) -> tuple[str, float]:
    """(label, bytes) for ``--gpu NAME`` or ``--gpu-mem GB`` (which wins)."""
    if override_gb is not None:
        if override_gb <= 0:
            raise GenomeLMError(f"--gpu-mem {override_gb}: must be positive (GB)")
        return f"{override_gb:g} GB", override_gb * 1e9
    key = name.upper()
    if key not in GPUS:
        raise GenomeLMError(f"--gpu {name}: unknown GPU (known: {', '.join(GPUS)}; or give --gpu-mem GB)")
    return key, GPUS[key]
