"""`genome-lm preflight`: what one GPU says about a cluster run, before the cluster is booked.

Six sections, each timed, each ok / fail / skip with its reason, written to the JSON file as
soon as it ends (an interrupted preflight keeps what it measured):

  environment  versions, device, free memory; which optional packages are missing and what that
               turns off (mlflow: tracking; ray: cluster launch; transformer-engine: the TE spec
               provider, the local one is used; fla-core: the "fla" KDA backend);
  compile      every Triton kernel compiled for this GPU's target at the shipped configs'
               per-rank shapes: shared memory, registers, spills, tensor-core instructions;
  parity       each kernel against its reference at real shapes, forward and backward, within
               its precision's bound (``kernels.py``), and the whole model in bf16 through those
               kernels against its fp32 torch path at a real layer size (``model.precision``);
  speed        own KDA vs fla-core's chunk_kda, and the DSA layer's kernels (indexer + sparse
               attention) vs dense causal attention through torch SDPA (flash), at 32k and 128k;
  slice        the 4-layer slice of GLM-5.3-Flash, one forward+backward at 32k: measured peak
               next to ``genome-lm plan`` (``model.py``);
  resume       the tiny model through the real trainer: 4 steps straight vs 2 + resume 2.

On a CPU the same sections run at tiny shapes under Triton's interpreter (a CI test), with the
compile check for sm_90 standing in for the device's own target.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from .sections import SECTIONS, Context, Section, Skip  # noqa: F401


def _sections() -> dict[str, Callable[[Context], tuple[list[dict], str]]]:
    from . import environment, kernels, model

    return {"environment": environment.environment, "compile": environment.compile_check,
            "parity": kernels.parity, "speed": kernels.speed, "slice": model.slice_peak, "resume": model.resume}


def device_target() -> str | None:
    """The compile-check target of the visible GPU (sm_90 for H100/H200, sm_100 for B200)."""
    import torch

    major, _ = torch.cuda.get_device_capability()
    return {9: "sm_90", 10: "sm_100"}.get(major)


def run_preflight(out: Path, *, only: tuple[str, ...] = SECTIONS, dataset: Path | None = None, quick: bool = False,
                  on_section: Callable[[Section], None] | None = None) -> dict:
    """Run the sections, writing ``out`` (JSON) after each; returns the report."""
    import torch

    gpu = torch.cuda.is_available()
    report: dict = {"profile": None, "sections": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with tempfile.TemporaryDirectory(prefix="genome-lm-preflight-") as tmp:
        ctx = Context(gpu=gpu, device="cuda" if gpu else "cpu", target=device_target() if gpu else "sm_90",
                      work_dir=Path(tmp), dataset=dataset, quick=quick)
        report["profile"] = ctx.profile
        table = _sections()
        for name in SECTIONS:
            if name not in only:
                continue
            start = time.perf_counter()
            try:
                rows, note = table[name](ctx)
                failed = [r for r in rows if r.get("ok") is False]
                status = "fail" if failed else "ok"
            except Skip as why:
                rows, note, status = [], str(why), "skip"
            except Exception as err:  # noqa: BLE001 - one section's failure must not hide the others
                rows, status = [], "fail"
                note = f"{type(err).__name__}: {err}".strip()[:2000]
                report.setdefault("tracebacks", {})[name] = traceback.format_exc()[-6000:]
            section = Section(name, status, round(time.perf_counter() - start, 1), rows, note)
            if name == "speed" and gpu:
                from .kernels import recommended_backend

                report["recommended_kernel_backend"], report["recommended_from"] = recommended_backend(rows)
            report["sections"].append(asdict(section))
            if gpu:
                torch.cuda.empty_cache()
            _write(out, report)
            if on_section:
                on_section(section)
    report["ok"] = all(s["status"] != "fail" for s in report["sections"])
    _write(out, report)
    return report


def _write(path: Path, report: dict) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)
