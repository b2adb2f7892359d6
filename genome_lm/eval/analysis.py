"""Reading an evaluation back for analysis (what ``notebooks/eval_analysis.ipynb`` calls).

    report = load_result("runs/demo-cpu/eval-chr22/eval.json")
    run = mlflow_run(report)                 # the MLflow run the evaluation logged
    table(report)                            # one row per model and bucket (pandas)
    figure(report)                           # loss vs context, change vs baseline, planted copies
"""

from __future__ import annotations

import json
from pathlib import Path

from genome_lm.errors import GenomeLMError
from genome_lm.tracking import read_run

from . import report as rep
from .planted import distance_figure, verdict
from .schema import EvalReport


def load_result(path: str | Path) -> EvalReport:
    """An ``eval.json`` as an ``EvalReport``, checked to be of the schema this version reads."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GenomeLMError(f"{path}: cannot read the evaluation result ({exc})") from None
    try:
        return EvalReport.from_json(data)
    except ValueError as exc:
        raise GenomeLMError(f"{path}: not an evaluation report this genome-lm reads: {exc}") from None


def mlflow_run(report: EvalReport) -> dict:
    """The evaluation's MLflow run as plain data: {run_id, parent_run_id, metrics, params, tags,
    artifacts}; empty when the evaluation was not tracked."""
    info = report.mlflow
    if info is None or not info.run_id:
        return {}
    return read_run(info.tracking_uri, info.run_id)


def table(report: EvalReport):
    """The CSV's rows as a pandas DataFrame."""
    import pandas as pd

    return pd.DataFrame(rep.csv_rows(report))


def figure(report: EvalReport):
    """The comparison for a paper: loss against context per model with 95% intervals, the change
    against the baseline, and the planted copies when the genome has them, side by side."""
    import matplotlib.pyplot as plt

    panels = 1 + bool(report.comparison) + bool(report.planted)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    rep.loss_figure(report, axes[:2] if report.comparison else axes[:1])
    if report.planted:
        distance_figure(report.planted, axes[-1])
    fig.tight_layout()
    return fig


def summary(report: EvalReport) -> str:
    """A few lines: data, models, overall loss and change, the planted-copies verdict."""
    data = report.data
    lines = [f"{data.chrom} ({data.split}): {len(data.windows)} windows of up to {data.window_length:,} "
             f"bases, {data.tokens:,} scored bases"]
    for name, entry in report.results.items():
        lines.append(f"{name}: {entry.all.nats:.4f} nats/base ({entry.all.bits:.4f} bits), "
                     f"95% CI {entry.all.nats_ci[0]:.4f}-{entry.all.nats_ci[1]:.4f}")
    comparison = report.comparison
    if comparison and comparison.all.change is not None:
        lo, hi = comparison.all.ci
        lines.append(f"change vs baseline: {comparison.all.change * 100:+.2f}% "
                     f"(95% CI {lo * 100:+.2f}% to {hi * 100:+.2f}%)")
    if report.planted:
        lines += [verdict(report.planted, name) for name in report.results]
    return "\n".join(lines)
