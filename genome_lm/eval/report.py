"""The evaluation report: built from token scores, put in words, written as JSON, CSV and PNG.

The report's types and its JSON schema (``genome-lm.eval/1``) are in ``schema``; this module
fills them (``summarize``), says what they show (``headline``, ``study_summary``) and writes
the files. Every file is written to a temporary name and renamed, so a failed run leaves no
half-written output.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

import numpy as np

from genome_lm.records import Document

from .ablation import beyond_line, gain_line
from .ablation import csv_rows as ablation_rows
from .buckets import (
    WindowSums,
    bucket_centres,
    change_interval,
    errorbars,
    finite,
    mean_interval,
    resample_weights,
    subset_and_bucket_sums,
    units_text,
    window_units,
)
from .schema import (
    SUBSETS,
    BucketChange,
    BucketStat,
    Change,
    Comparison,
    EvalReport,
    ModelResult,
    Stat,
)
from .score import TokenScores

LN2 = math.log(2)


def _stat(tokens, mean, lo, hi, **span) -> Stat:
    cls = BucketStat if span else Stat
    return cls(tokens=int(tokens), nats=finite(mean), nats_ci=(finite(lo), finite(hi)), bits=finite(mean / LN2),
               bits_ci=(finite(lo / LN2), finite(hi / LN2)), **span)


def summarize(scores: dict[str, TokenScores], edges: list[int], *, resamples: int = 1000, seed: int = 0,
              level: float = 0.95, units: tuple[np.ndarray, int] | None = None
              ) -> tuple[dict[str, ModelResult], Comparison | None]:
    """(results, comparison) of the report from each model's token scores (same tokens for all:
    the first model named is compared against "baseline" when present). ``units``: (unit [N],
    count) of the bootstrap (``buckets.bootstrap_units``); default: the windows."""
    names = list(scores)
    first = scores[names[0]]
    for name in names[1:]:
        if not first.same_tokens(scores[name]):
            raise ValueError(f"models {names[0]} and {name} were scored on different tokens")
    window_pos, n_units = units or window_units(first)
    sums = {name: subset_and_bucket_sums(s, window_pos, n_units, edges) for name, s in scores.items()}
    return summarize_sums(sums, edges, resample_weights(n_units, resamples, seed), level)


def summarize_sums(sums: dict[str, tuple[WindowSums, WindowSums]], edges: list[int], weights: np.ndarray,
                   level: float = 0.95) -> tuple[dict[str, ModelResult], Comparison | None]:
    """``summarize`` from each model's per-unit sums (subsets, buckets) and the bootstrap's
    resample weights [R, units] (``pooled`` gives those of several folds)."""
    names = list(sums)
    spans = [{"start": edges[b], "end": edges[b + 1]} for b in range(len(edges) - 1)]
    results = {}
    for name, (subsets, buckets) in sums.items():
        mean, lo, hi = mean_interval(subsets, weights, level)
        parts = {subset: _stat(subsets.counts[:, i].sum(), mean[i], lo[i], hi[i]) for i, subset in enumerate(SUBSETS)}
        mean, lo, hi = mean_interval(buckets, weights, level)
        results[name] = ModelResult(**parts, buckets=[_stat(buckets.counts[:, b].sum(), mean[b], lo[b], hi[b], **span)
                                                      for b, span in enumerate(spans)])
    if "baseline" not in sums or len(names) < 2:
        return results, None
    target = next(n for n in names if n != "baseline")
    change, lo, hi = change_interval(sums["baseline"][0], sums[target][0], weights, level)
    parts = {subset: Change(change=finite(change[i]), ci=(finite(lo[i]), finite(hi[i])))
             for i, subset in enumerate(SUBSETS)}
    change, lo, hi = change_interval(sums["baseline"][1], sums[target][1], weights, level)
    buckets = [BucketChange(change=finite(change[b]), ci=(finite(lo[b]), finite(hi[b])), **span)
               for b, span in enumerate(spans)]
    return results, Comparison(**parts, buckets=buckets)


BASELINE_NAMES = {"init": "the run's starting weights", "checkpoint": "another checkpoint",
                  "huggingface": "a Hugging Face checkpoint", "preset": "a freshly initialised model"}


def headline(report: EvalReport) -> list[str]:
    """One line per comparison of the model's overall loss, each naming what it compares with:
    the baselines that need no model (uniform, the Markov chain) and ``--baseline`` when given."""
    results, models = report.results, report.models
    model = results["model"].all
    if model.nats is None:
        return []
    lines = []
    for name in ("uniform", "markov"):
        if name not in results or results[name].all.nats is None:
            continue
        other = results[name].all
        change = (model.nats - other.nats) / other.nats * 100
        what = ("guessing A, C, G, T uniformly" if name == "uniform"
                else f"an order-{models[name].order} Markov chain fitted on the training split")
        lines.append(f"model {model.bits:.4f} bits/base vs {other.bits:.4f} for {what}: "
                     f"{abs(change):.2f}% {'lower' if change < 0 else 'higher'}")
    comparison = report.comparison
    if comparison and comparison.all.change is not None:
        info = models.get("baseline")
        kind = info.kind if info is not None else None
        what = BASELINE_NAMES.get(kind, kind or "the baseline")
        change, (lo, hi) = comparison.all.change * 100, comparison.all.ci
        lines.append(f"model vs --baseline ({what}): loss {'fell' if change < 0 else 'rose'} {abs(change):.2f}% "
                     f"(95% CI {lo * 100:+.2f}% to {hi * 100:+.2f}%)")
    for cut in report.ablation.cuts if report.ablation else []:
        lines.append(_ablation_line(cut))
    return lines


def _pct(change: Change) -> str:
    lo, hi = change.ci
    return f"{change.change * 100:+.2f}% [{lo * 100:+.2f}, {hi * 100:+.2f}]"


def study_summary(report: EvalReport) -> list[str]:
    """The study's answer in plain words (``genome-lm demo --fasta``): does the model beat the
    Markov chain; where its loss changed most and least against ``--baseline`` (by context
    bucket), on repeats and elsewhere; and whether its context beyond each cut is used."""
    results, models, comparison = report.results, report.models, report.comparison
    lines = []
    if units_text(report) != "windows":
        lines.append(f"{len(report.data.windows)} overlapping windows score each held-out base at several "
                     f"context lengths; the intervals are over {units_text(report)} of sequence")
    model = results["model"].all
    markov = results["markov"].all if "markov" in results else None
    if model.nats is not None and markov is not None and markov.nats is not None:
        lo, hi = model.bits_ci
        verdict = ("beats it" if hi is not None and hi < markov.bits else
                   "does not beat it" if lo is not None and lo > markov.bits else
                   "is level with it (within the interval)")
        lines.append(f"against the order-{models['markov'].order} Markov chain fitted on the training regions "
                     f"({markov.bits:.4f} bits/base), the model ({model.bits:.4f} [{lo:.4f}, {hi:.4f}]) {verdict}")
    if comparison:
        buckets = [b for b, r in zip(comparison.buckets, results["model"].buckets) if r.tokens and b.measured]
        if buckets:
            most, least = min(buckets, key=lambda b: b.change), max(buckets, key=lambda b: b.change)
            longest = buckets[-1]
            lines.append(f"against its starting weights the loss changed most at {most.start:,}-{most.end - 1:,} "
                         f"bases of context ({_pct(most)}), least at {least.start:,}-{least.end - 1:,} "
                         f"({_pct(least)}); at the longest, {longest.start:,}-{longest.end - 1:,}: {_pct(longest)}")
        parts = [f"{name} {_pct(change)}" for change, name in ((comparison.unmasked, "unmasked bases"),
                                                               (comparison.softmasked, "soft-masked (repeat) bases"))
                 if change.measured]
        if parts:
            lines.append("change against the starting weights on " + "; on ".join(parts))
    for cut in report.ablation.cuts if report.ablation else []:
        if (line := beyond_line(cut)) is not None:
            lines.append(line)
        if (line := gain_line(cut, "its starting weights")) is not None:
            lines.append(line)
    return lines


def _ablation_line(cut) -> str:
    """The model against itself with its context cut to N (``--max-context``): the baseline that
    asks whether the context beyond N bases is used at all."""
    cut_nats, delta, (lo, hi) = cut.all.nats, cut.all.delta, cut.all.ci  # delta: cut - whole
    what = f"model vs the same model with its context cut to {cut.max_context:,} bases"
    if cut_nats is None or delta is None or lo is None:
        return f"{what}: not measured (no scored base)"
    change = -delta / cut_nats * 100
    words = "lower" if delta > 0 else "higher"
    uses = ("the context beyond it is used" if lo > 0 else
            "no use of the context beyond it shown" if hi >= 0 else "the context beyond it hurts")
    return (f"{what}: loss {abs(change):.2f}% {words} with the whole window ({-delta:+.4f} nats/base, "
            f"95% CI {-hi:+.4f} to {-lo:+.4f}): {uses}")


# ----------------------------------------------------------------------------- files


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(report: Document, path: Path) -> None:
    """A typed report (eval.json, variants.json, folds.json) written whole, NaN refused."""
    atomic_write(path, (json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n").encode())


def csv_rows(report: EvalReport) -> list[dict]:
    """One row per model and subset / bucket, with the change against the baseline."""
    comparison = report.comparison
    rows = []
    for name, entry in report.results.items():
        changes = {subset: getattr(comparison, subset) if comparison else None for subset in SUBSETS}
        parts = [(subset, None, None, getattr(entry, subset), changes[subset]) for subset in SUBSETS]
        parts += [("bucket", b.start, b.end, b, comparison.buckets[i] if comparison else None)
                  for i, b in enumerate(entry.buckets)]
        for subset, lo, hi, stat, change in parts:
            own = name != "baseline" and change is not None
            rows.append({"model": name, "subset": subset, "context_from": lo, "context_to": hi,
                         "tokens": stat.tokens, "nats": stat.nats, "nats_ci_low": stat.nats_ci[0],
                         "nats_ci_high": stat.nats_ci[1], "bits": stat.bits, "bits_ci_low": stat.bits_ci[0],
                         "bits_ci_high": stat.bits_ci[1],
                         "change_vs_baseline": change.change if own else None,
                         "change_ci_low": change.ci[0] if own else None,
                         "change_ci_high": change.ci[1] if own else None})
    return rows


ABLATION_COLUMNS = ("max_context", "delta_vs_whole_window", "delta_ci_low", "delta_ci_high")


def write_csv(report: EvalReport, path: Path) -> None:
    rows = csv_rows(report)
    if report.ablation:
        rows = [{**row, **dict.fromkeys(ABLATION_COLUMNS)} for row in rows]
        rows += [{key: row.get(key) for key in rows[0]} for row in ablation_rows(report.ablation)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    atomic_write(path, buf.getvalue().encode())


def _save_figure(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write(path, buf.getvalue())


def loss_figure(report: EvalReport, axes=None):
    """Loss (nats per base, the tables' unit) against preceding context per model, with bootstrap
    intervals, and the relative change against the baseline when there is one (a second panel).
    ``axes``: draw into these (one, or two with a baseline) instead of a new figure."""
    import matplotlib.pyplot as plt

    comparison = report.comparison
    if axes is None:
        fig, grid = plt.subplots(1, 2 if comparison else 1, figsize=(11 if comparison else 6, 4), squeeze=False)
        axes = list(grid[0])
    fig = axes[0].figure
    ax = axes[0]
    for name, entry in report.results.items():
        buckets = [b for b in entry.buckets if b.tokens]
        y, err = errorbars(buckets, "nats", "nats_ci")
        ax.errorbar(bucket_centres(buckets), y, yerr=err, marker="o", capsize=3, label=_label(report, name))
    ax.set_xscale("log")
    ax.set_xlabel("preceding context in the window (bases)")
    ax.set_ylabel("loss (nats per base)")
    where = report.data.chrom or report.data.split
    ax.set_title(f"{where}: loss by context (95% CI over {units_text(report)})")
    ax.legend()
    if comparison and len(axes) > 1:
        ax = axes[1]
        stats = [c for c, b in zip(comparison.buckets, report.results["model"].buckets) if b.tokens]
        y, err = errorbars(stats, "change", "ci", 100)
        ax.errorbar(bucket_centres(stats), y, yerr=err, marker="o", capsize=3, color="C2")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("preceding context in the window (bases)")
        ax.set_ylabel("change vs baseline (%)")
        overall = comparison.all.change
        ax.set_title(f"model vs baseline: {overall * 100:+.2f}% overall" if overall is not None
                     else "model vs baseline")
    fig.tight_layout()
    return fig


def _label(report: EvalReport, name: str) -> str:
    info = report.models[name]
    if name == "uniform":
        return "uniform (1/4 per base, no model)"
    if name == "markov":
        return f"order-{info.order} Markov chain (training split)"
    step = f" step {info.step}" if info.step is not None else ""
    return f"{name} ({info.shipped or info.kind}{step})"


def write_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        _save_figure(fig, path)
    finally:
        plt.close(fig)
