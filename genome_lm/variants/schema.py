"""The variant report as types: ``VariantsReport`` and its parts, written as ``variants.json``.

Schema ``genome-lm.variants/1`` (``VariantsReport.to_json`` gives it, ``VariantsReport.from_json``
reads it back and checks it, with ``records``). The JSON keys are the field names below::

    schema, created, genome_lm   "genome-lm.variants/1", ISO time, the package version
    seconds     how long the run took
    settings    Settings: the request (VCF, FASTA, contexts, strand, score, labels, ...)
    models      Models: "model", "baseline" if given (eval's ModelInfo), and "markov", the
                order-k chain fitted on the FASTA's records (MarkovInfo: it has no file)
    data        Data: variants scored by kind, the skipped ones with their reasons
    metrics     None without --label, else Metrics: AUROC/AUPRC with intervals per score
                ("model@4096", "baseline@4096", "markov", a --compare field), overall and per
                consequence class, and paired AUROC differences
    summary     the findings in words
    files, mlflow   where the outputs and the MLflow run are
"""

from __future__ import annotations

from dataclasses import dataclass, field

from genome_lm.eval.schema import MlflowInfo, ModelInfo
from genome_lm.records import Document, omit_none

SCHEMA = "genome-lm.variants/1"

Interval = tuple[float, float]  # [low, high] of a 95% bootstrap interval


@dataclass(kw_only=True)
class Settings:
    vcf: str
    fasta: str
    contexts: list[int]  # preceding context, bases
    right: int  # following context, bases
    reverse_complement: bool
    score: str  # the ratio the metrics rank by: sum or mean
    max_indel: int
    label: str | None
    positive: list[str]
    negative: list[str] | None
    compare: list[str]
    resamples: int
    seed: int
    chunk: int | None


@dataclass(kw_only=True)
class MarkovInfo:
    order: int
    fitted_on: list[str]  # the FASTA records whose N-free stretches it was fitted on
    bases: int


@dataclass(kw_only=True)
class Models:
    model: ModelInfo
    baseline: ModelInfo | None = omit_none()
    markov: MarkovInfo


@dataclass(kw_only=True)
class Skipped:
    variant: str
    reason: str


@dataclass(kw_only=True)
class Data:
    variants: int
    kinds: dict[str, int]  # snv, insertion, deletion
    skipped: int
    skipped_by_reason: dict[str, int]
    skipped_variants: list[Skipped]
    positives: int | None = omit_none()  # with --label
    negatives: int | None = omit_none()


@dataclass(kw_only=True)
class Estimate:
    value: float
    ci: Interval


@dataclass(kw_only=True)
class ScoreMetrics:
    n: int  # variants with this score
    positives: int
    auroc: Estimate
    auprc: Estimate


@dataclass(kw_only=True)
class PositiveClass:
    label: str | None
    positive: list[str]
    negative: list[str] | None  # None: every other value is negative


@dataclass(kw_only=True)
class Difference:
    """AUROC of score ``a`` minus that of ``b`` on the ``n`` variants both scored, paired."""

    a: str
    b: str
    n: int
    auroc_difference: float
    ci: Interval


@dataclass(kw_only=True)
class Metrics:
    positive_class: PositiveClass
    overall: dict[str, ScoreMetrics]
    by_consequence: dict[str, dict[str, ScoreMetrics]]
    differences: list[Difference]
    # pairs left out because the variants both scored hold one class only: "a vs b: why"
    not_compared: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class VariantsReport(Document):
    schema: str = SCHEMA
    seconds: float
    settings: Settings
    models: Models
    data: Data
    metrics: Metrics | None = None
    summary: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    mlflow: MlflowInfo | None = omit_none()
