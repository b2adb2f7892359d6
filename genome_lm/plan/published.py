"""The published run's memory figures (docs/design.md, section 1) next to the plan's.

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


# ------------------------------------------------------------------------------------ time
# The published run's setting for its time figures: the shipped configs with the MoE chunks not
# checkpointed one by one (the SkyRL recipe passes MoE layers in 64 chunks,
# mlp_chunks_for_training; recomputing each chunk is genome-lm's own addition for memory).
# It ran on one stream: nothing overlapped (the time model's overlaps off).
PUBLISHED_TIME_SETTING = {"memory": {"moe_chunk_recompute": False},
                          "parallel": {"split_dsa_selection": False, "overlap_grad_reduce": False,
                                       "moe_shared_expert_overlap": False}}


@dataclass(frozen=True)
class PublishedTime:
    figure: str
    value: float  # tokens/s, or a fraction (the step-time cost of offload)
    unit: str  # "tokens/s" or "%"
    config: str
    changes: dict
    fitted: bool  # the one figure the time model's kernel efficiency is fitted on

    def run_changes(self) -> dict:
        """The changes from the shipped config: the published setting's and the figure's own."""
        changes = {k: dict(v) for k, v in PUBLISHED_TIME_SETTING.items()}
        for section, fields in self.changes.items():
            changes.setdefault(section, {}).update(fields)
        return changes

    def run(self):
        return with_changes(load_config(self.config), **self.run_changes())

    def shipped_run(self):
        """The shipped config with the figure's own changes only (as `plan` runs it)."""
        return with_changes(load_config(self.config), **self.changes)


TIME_FIGURES = [
    PublishedTime("tokens/s at 1M, 64 x B200", 13700, "tokens/s", "glm-5.3-flash-1m-64xb200", {}, fitted=True),
    PublishedTime("tokens/s at 256k, 64 x B200", 24900, "tokens/s", "glm-5.3-flash-512k-64xb200",
                  {"data": {"seq_len": 262144}}, fitted=False),
    PublishedTime("step-time cost of activation offload at 256k", 0.21, "%", "glm-5.3-flash-512k-64xb200",
                  {"data": {"seq_len": 262144}}, fitted=False),
]


def predicted_time(fig: PublishedTime, hw: Hardware = Hardware(), constants=None, shipped: bool = False) -> float:
    """The time model's figure for ``fig``: tokens/s, or the offload's step-time cost, in the
    published run's setting, or (``shipped``) in the shipped config's."""
    from .time_model import CONSTANTS, estimate_time

    c = constants or CONSTANTS
    run = fig.shipped_run() if shipped else fig.run()
    if fig.unit == "%":
        off = with_changes(run, memory={"offload_activations": False})
        return estimate_time(run, hw, c=c).step_seconds / estimate_time(off, hw, c=c).step_seconds - 1
    return estimate_time(run, hw, c=c).tokens_per_s


def compare_time(hw: Hardware = Hardware(), constants=None) -> list[tuple[PublishedTime, float]]:
    """(figure, predicted) for each published time figure."""
    return [(fig, predicted_time(fig, hw, constants)) for fig in TIME_FIGURES]


# ------------------------------------------------------------------- naming the two apart
# What the published setting turns off, in words, most telling first
SETTING_WORDS = {("parallel", "split_dsa_selection"): "DSA selection on every rank",
                 ("memory", "moe_chunk_recompute"): "MoE chunks not recomputed",
                 ("parallel", "overlap_grad_reduce"): "gradient reduction not overlapped",
                 ("parallel", "moe_shared_expert_overlap"): "shared expert not overlapped"}


def setting_words(run) -> str:
    """How the published run's setting differs from ``run``, in words ("" where it does not)."""
    return ", ".join(words for (section, name), words in SETTING_WORDS.items()
                     if getattr(getattr(run, section), name) != PUBLISHED_TIME_SETTING[section][name])


def _layout(run) -> tuple:
    """What the published setting of ``run`` keeps from it: the model, layout, memory and batch."""
    r = with_changes(run, **PUBLISHED_TIME_SETTING)
    return (r.model.preset, r.parallel.model_dump(exclude={"gpus"}), r.memory.model_dump(),
            r.train.global_batch_size, r.train.micro_batch_size)


def published_config(run) -> str | None:
    """The shipped config a published time figure names whose layout ``run`` has (at any
    length): then ``run`` with the published setting is the published run's setting. Else None."""
    return next((name for name in dict.fromkeys(f.config for f in TIME_FIGURES)
                 if _layout(load_config(name)) == _layout(run)), None)


def published_label(run, config_label: str) -> tuple[str, str]:
    """(short, long) names of ``run`` with the published setting: the published run's setting
    where ``run`` has its layout, else ``config_label``'s layout with the published run's
    switches; the long one says how it differs from ``run``."""
    name, words = published_config(run), setting_words(run)
    if name is None:
        short, what = "the published run's switches", config_label
    else:
        short, what = "the published run's setting", name
    return short, f"{short} ({what}{' with ' + words if words else ''})"
