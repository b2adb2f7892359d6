"""The evaluation report as types: ``EvalReport`` and its parts, written as ``eval.json``.

Schema ``genome-lm.eval/1`` (``EvalReport.to_json`` gives it, ``EvalReport.from_json`` reads it
back and checks it; NaN is written as null). The JSON keys are the field names below, except
``from``/``to`` (``start``/``end`` here, Python keywords)::

    schema, created, genome_lm     "genome-lm.eval/1", ISO time, the package version
    data        Data: dataset, split, chrom, source, windows, window_length, tokens
    settings    Settings: chunk, edges, bootstrap {resamples, seed, level, unit, units}, ...
    models      {name: ModelInfo}: "model", "baseline" if given, the baselines that need no
                model ("uniform", "markov"; kind "baseline")
    results     {name: ModelResult}: all, unmasked, softmasked (Stat), buckets [BucketStat]
    comparison  None, or Comparison: (model - baseline) / baseline with a paired interval
    ablation    None, or Ablation: the model against itself with its context cut (``ablation``)
    planted     None, or Planted: the planted-copies analysis (``planted``)
    headline    the overall comparisons in words
    files, mlflow   where the outputs and the MLflow run are

Reports written by earlier releases of schema 1 lack some later fields (``tokens_softmasked``,
``beyond``, the layout...): those fields have defaults, so the old files still read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from genome_lm.records import Document, json_name, omit_none

SCHEMA = "genome-lm.eval/1"
SUBSETS = ("all", "unmasked", "softmasked")

Interval = tuple[float | None, float | None]  # [low, high] of a 95% bootstrap interval; None: not measured


def interval_side(ci: Interval, at: float = 0.0) -> int | None:
    """Where the interval ``ci`` lies: 1 above ``at``, -1 below it, 0 when it holds it; None when
    it was not measured."""
    lo, hi = ci
    if lo is None or hi is None:
        return None
    return 1 if lo > at else -1 if hi < at else 0


@dataclass(kw_only=True)
class Span:
    """A context bucket: bases with ``start <= context < end`` (JSON ``from``, ``to``)."""

    start: int = json_name("from")
    end: int = json_name("to")


@dataclass(kw_only=True)
class Stat:
    """A model's mean loss on some bases, with its interval, in nats and bits per base."""

    tokens: int
    nats: float | None
    nats_ci: Interval
    bits: float | None
    bits_ci: Interval


@dataclass(kw_only=True)
class BucketStat(Stat, Span):
    pass


@dataclass(kw_only=True)
class ModelResult:
    all: Stat
    unmasked: Stat
    softmasked: Stat
    buckets: list[BucketStat]


@dataclass(kw_only=True)
class Change:
    """(model - baseline) / baseline on the same bases, with a paired interval."""

    change: float | None
    ci: Interval

    @property
    def measured(self) -> bool:
        return self.change is not None and self.ci[0] is not None


@dataclass(kw_only=True)
class BucketChange(Change, Span):
    pass


@dataclass(kw_only=True)
class Comparison:
    all: Change
    unmasked: Change
    softmasked: Change
    buckets: list[BucketChange]


@dataclass(kw_only=True)
class Delta:
    """loss(context cut) - loss(whole window) on the same bases (``nats``: the cut's loss; None
    for a gain, which is one model's delta minus another's)."""

    tokens: int
    nats: float | None
    delta: float | None
    ci: Interval


@dataclass(kw_only=True)
class BucketDelta(Delta, Span):
    pass


@dataclass(kw_only=True)
class Beyond:
    """The bases with at least ``start`` (twice the cut) bases of context."""

    start: int = json_name("from")
    all: Delta
    unmasked: Delta
    softmasked: Delta


@dataclass(kw_only=True)
class Deltas:
    all: Delta
    unmasked: Delta
    softmasked: Delta
    buckets: list[BucketDelta]
    beyond: Beyond | None = omit_none()


@dataclass(kw_only=True)
class CutSize:
    max_context: int


@dataclass(kw_only=True)
class Cut(Deltas, CutSize):
    """One ``--max-context`` cut: the model's deltas; with a baseline also the baseline's own and
    the model's minus the baseline's (``gain``)."""

    baseline: Deltas | None = omit_none()
    gain: Deltas | None = omit_none()


@dataclass(kw_only=True)
class Ablation:
    model: str
    cuts: list[Cut]


@dataclass(kw_only=True)
class CopyGroup:
    """Planted-copy bases whose first copy is in (or out of) the window."""

    tokens: int
    copies: int
    nats: float | None
    nats_ci: Interval


@dataclass(kw_only=True)
class Advantage:
    """Loss out of context minus in context: what seeing the first copy is worth."""

    nats: float
    ci: Interval
    excludes_zero: bool


@dataclass(kw_only=True)
class DistanceRow(Span):
    """Copy bases whose first copy lies ``start``-``end`` bases before them."""

    in_context_tokens: int
    in_context_nats: float | None
    in_context_copies: int
    out_of_context_tokens: int
    out_of_context_nats: float | None
    out_of_context_copies: int
    advantage: float | None
    advantage_ci: Interval


@dataclass(kw_only=True)
class PlantedModel:
    in_context: CopyGroup
    out_of_context: CopyGroup
    background_nats: float | None
    advantage: Advantage | None
    by_distance: list[DistanceRow]
    # "model" only, with a baseline: its advantage minus the baseline's, paired over the same copies
    change_vs_baseline: Advantage | None = omit_none()


@dataclass(kw_only=True)
class Planted:
    copies_total: int
    tokens_on_copies: int
    tokens_in_context: int
    tokens_out_of_context: int
    distance_edges: list[int]
    models: dict[str, PlantedModel]
    source: str | None = omit_none()


@dataclass(kw_only=True)
class Data:
    dataset: str
    split: str
    chrom: str
    source: str | None
    windows: list[int]
    window_length: int
    tokens: int
    tokens_softmasked: int | None = omit_none()


@dataclass(kw_only=True)
class Bootstrap:
    resamples: int
    seed: int
    level: float
    unit: str = "window"
    units: int | None = omit_none()


@dataclass(kw_only=True)
class Settings:
    chunk: int | None
    edges: list[int]
    bootstrap: Bootstrap
    max_n_fraction: float | None = omit_none()
    ranks: int | None = omit_none()
    layout: dict | None = omit_none()  # the ParallelSizes fields


@dataclass(kw_only=True)
class ModelInfo:
    """What was scored: a checkpoint, a training run's starting weights, a Hugging Face folder,
    a freshly initialised preset, or a baseline that needs no model."""

    kind: str  # checkpoint, init, huggingface, preset, baseline
    path: str | None = None
    step: int | None = None
    preset: str | None = omit_none()
    seed: int | None = omit_none()
    checkpoint: str | None = omit_none()  # the checkpoint the training run started from
    shipped: str | None = omit_none()  # the name of a model shipped with the package
    model_type: str | None = omit_none()
    order: int | None = omit_none()  # a Markov chain's
    description: str | None = omit_none()
    held_out_nats_by_order: dict[str, float] | None = omit_none()


@dataclass(kw_only=True)
class MlflowInfo:
    tracking_uri: str | None = None
    run_id: str | None = None
    experiment_id: str | None = None
    location: str | None = None


@dataclass(kw_only=True)
class EvalReport(Document):
    schema: str = SCHEMA
    data: Data
    settings: Settings
    models: dict[str, ModelInfo]
    results: dict[str, ModelResult]
    comparison: Comparison | None = None
    ablation: Ablation | None = None
    planted: Planted | None = None
    headline: list[str] = field(default_factory=list)
    files: dict[str, str] | None = omit_none()
    mlflow: MlflowInfo | None = omit_none()
