"""Preflight sections ``environment`` and ``compile``."""

from __future__ import annotations

import platform
from importlib import metadata

from .sections import Skip

# distribution -> what its absence turns off (None: required)
PACKAGES = {
    "torch": None,
    "triton": None,
    "megatron-core": None,
    "numpy": None,
    "pydantic": None,
    "safetensors": None,
    "transformers": "parity against transformers' glm5_next and Hugging Face tokenizers",
    "fla-core": "the 'fla' KDA backend (fla-core's chunk_kda)",
    "transformer-engine": "Transformer Engine layers: megatron-core's local (torch) spec is used",
    "mlflow": "experiment tracking (training runs without it, with one warning)",
    "ray": "launching on a Ray cluster (--ray-address); torchrun still works",
    "pysam": "genome-lm prepare (FASTA reading); training on a prepared dataset still works",
    "pyfaidx": "the FASTA oracle of the data tests",
}


def _version(dist: str) -> str | None:
    for name in (dist, dist.replace("-", "_")):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(ctx) -> tuple[list[dict], str]:
    import torch

    rows = [{"item": "python", "value": platform.python_version()}]
    missing_required = []
    for dist, without in PACKAGES.items():
        version = _version(dist)
        row = {"item": dist, "value": version or "absent"}
        if version is None:
            row["note"] = "required" if without is None else f"off: {without}"
            if without is None:
                missing_required.append(dist)
                row["ok"] = False
        rows.append(row)
    if ctx.gpu:
        free, total = torch.cuda.mem_get_info()
        major, minor = torch.cuda.get_device_capability()
        rows += [{"item": "device", "value": torch.cuda.get_device_name()},
                 {"item": "compute capability", "value": f"{major}.{minor} ({ctx.target or 'no compile target'})"},
                 {"item": "memory free / total", "value": f"{free / 2**30:.1f} / {total / 2**30:.1f} GiB"},
                 {"item": "CUDA (torch)", "value": torch.version.cuda}]
    else:
        rows.append({"item": "device", "value": "cpu: kernels under TRITON_INTERPRET=1 at tiny shapes"})
    note = f"missing required: {', '.join(missing_required)}" if missing_required else ""
    return rows, note


def compile_check(ctx) -> tuple[list[dict], str]:
    """The compile check for this GPU's target at the TP 1 and TP 8 per-rank shapes (tensor-core
    precision); on a CPU, sm_90 at the TP 8 shapes only (the full sweep is
    ``genome-lm bench kernels --compile-for``). Triton's own cache is used, so with a warm
    cache the compile times are cache hits."""
    from genome_lm_kernels.compile_check import run_in_subprocess


    if ctx.target is None:
        raise Skip("no shared-memory limits known for this GPU's compute capability (sm_90 and sm_100 are)")
    heads = None if ctx.gpu else "8"
    reports = run_in_subprocess([ctx.target], "kda,dsa", kda_heads=heads, kda_backends="triton", dsa_heads=heads,
                                use_triton_cache=True)
    rows = [{"case": r["case"], "kernel": r["kernel"], "shared_bytes": r["shared_bytes"], "registers": r["registers"],
             "spill_stores": r["spill_stores"], "spill_loads": r["spill_loads"], "stack_bytes": r["local_bytes"],
             "mma": r["mma"], "compile_s": r["compile_s"],
             "ok": not r["problems"], **({"problem": "; ".join(r["problems"])} if r["problems"] else {})}
            for r in reports]
    return rows, f"{len(rows)} kernels compiled for {ctx.target}"
