"""The published run's memory figures (DESIGN.md section 1) next to the plan's.

Each row names the figure as published, the config and settings that reproduce its setup, and
how to read the plan for it. ``compare()`` returns (row, published, planned) for printing; the
docs (docs/plan.md) explain the rows that differ by more than 20%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from genome_lm.config import load_config

from .memory_model import GiB, Hardware, Plan, estimate, with_changes

MiB = 2**20


@dataclass(frozen=True)
class Published:
    figure: str
    value: float  # bytes
    unit: str  # "GiB" | "GB" | "MiB"
    config: str
    changes: dict  # section -> fields changed from the shipped config
    read: Callable[[Plan], float]
    source: str


def _peak(plan: Plan) -> float:
    return plan.peak


FIGURES = [
    Published("peak/GPU at 256k, no offload", 142 * GiB, "GiB", "glm-5.3-flash-512k-64xb200",
              {"data": {"seq_len": 262144}, "memory": {"offload_activations": False}}, _peak, "published run"),
    Published("peak/GPU at 256k, layer inputs offloaded", 98 * GiB, "GiB", "glm-5.3-flash-512k-64xb200",
              {"data": {"seq_len": 262144}}, _peak, "published run"),
    Published("peak/GPU at 1M", 144.5 * GiB, "GiB", "glm-5.3-flash-1m-64xb200", {}, _peak, "published run"),
    Published("host memory/GPU at 1M (offloaded inputs)", 180e9, "GB", "glm-5.3-flash-1m-64xb200", {},
              lambda p: sum(i.bytes for i in p.host if i.name == "offloaded activations"), "published run"),
    Published("offloaded inputs per token per GPU, TP 8", 1.4 * MiB, "MiB", "glm-5.3-flash-1m-64xb200", {},
              lambda p: p.offloaded_per_token, "SkyRL recipe"),
    Published("peak/GPU at 512k", 163 * GiB, "GiB", "glm-5.3-flash-512k-64xb200", {}, _peak, "SkyRL recipe"),
]

UNITS = {"GiB": GiB, "GB": 1e9, "MiB": MiB}


def compare(hw: Hardware = Hardware()) -> list[tuple[Published, float]]:
    """(figure, planned bytes) for each published figure."""
    rows = []
    for fig in FIGURES:
        run = with_changes(load_config(fig.config), **fig.changes) if fig.changes else load_config(fig.config)
        rows.append((fig, fig.read(estimate(run, hw))))
    return rows
