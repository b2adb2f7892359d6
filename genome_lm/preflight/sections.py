"""The pieces every preflight section shares: the result record, where it runs, and Skip."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = ("environment", "compile", "parity", "speed", "slice", "resume")


class Skip(Exception):
    """A section that cannot run here; its message says why and what would make it run."""


@dataclass
class Section:
    name: str
    status: str  # "ok", "fail" or "skip"
    seconds: float
    rows: list[dict] = field(default_factory=list)
    note: str = ""


@dataclass
class Context:
    """What every section needs to know about where it runs."""

    gpu: bool
    device: str  # "cuda" or "cpu"
    target: str | None  # the compile target of this GPU ("sm_90"), or None
    work_dir: Path
    dataset: Path | None = None  # a prepared dataset for the resume check (else one is made)
    quick: bool = False  # fewer lengths and repeats

    @property
    def profile(self) -> str:
        return "gpu" if self.gpu else "cpu (Triton interpreter, tiny shapes)"
