"""The variant report: metrics with intervals, a summary in words, and the files (JSON, TSV, ROC
curves, AUROC by preceding context) and MLflow run.

Every score is oriented so that higher means "more likely in the positive class" (damaging):
a model's or the Markov chain's log-likelihood ratio is negated (the alternative allele less
likely than the reference), a score taken from the VCF (``--compare``: CADD, phyloP) is used as
it is (higher: more deleterious, more conserved).
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from pathlib import Path

import numpy as np

from genome_lm.errors import GenomeLMError
from genome_lm.eval.report import atomic_write, write_json
from genome_lm.eval.schema import MlflowInfo
from genome_lm.records import to_json
from genome_lm.tracking import Tracker
from genome_lm.units import size_label

from .metrics import auprc, auroc, bootstrap, paired_difference
from .schema import Data, Difference, Estimate, Metrics, PositiveClass, ScoreMetrics, Skipped, VariantsReport

MIN_CLASS = 10  # positives and negatives a consequence class needs for its own AUROC


def reason_counts(skipped) -> dict[str, int]:
    """Skipped variants by reason, the reason's text without the variant's own position."""
    return dict(Counter(s.reason.split(" (")[0] for s in skipped).most_common())


def reasons_in_words(counts: dict[str, int]) -> str:
    """``reason_counts`` as a reader wants it: "3 REF does not match the FASTA, 1 window runs into N"."""
    return ", ".join(f"{n:,} {reason}" for reason, n in counts.items())


def combine(per_strand: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """{score name: {"sum": llr, "mean": llr}} averaged over the strands scored."""
    return {name: {"sum": np.mean([s for s, _ in runs], axis=0), "mean": np.mean([m for _, m in runs], axis=0)}
            for name, runs in per_strand.items()}


def compare_columns(variants, fields, vcf) -> dict[str, np.ndarray]:
    """The ``--compare`` INFO fields as numbers (NaN where a variant has none)."""

    out = {}
    for name in fields:
        values = []
        for v in variants:
            x = v.info.get(name)
            if isinstance(x, tuple):
                x = x[0] if x else None
            try:
                values.append(np.nan if x is None else float(x))
            except (TypeError, ValueError):
                raise GenomeLMError(f"{vcf}: --compare {name}: {v.key} has {x!r}, not a number") from None
        column = np.asarray(values, dtype=np.float64)
        if np.isnan(column).all():
            raise GenomeLMError(f"{vcf}: --compare {name}: no variant has a value")
        out[name] = column
    return out


def data_summary(variants, labels, skipped) -> Data:
    out = Data(variants=len(variants), kinds=dict(Counter(v.kind for v in variants)), skipped=len(skipped),
               skipped_by_reason=reason_counts(skipped),
               skipped_variants=[Skipped(variant=s.key, reason=s.reason) for s in skipped])
    if labels is not None:
        out.positives, out.negatives = int(np.sum(labels == 1)), int(np.sum(labels == 0))
    return out


def ranked(scores: dict, compare: dict, kind: str) -> dict[str, np.ndarray]:
    """Every score oriented higher = positive: models and the chain negated, VCF fields as is."""
    out = {name: -s[kind] for name, s in scores.items()}
    out.update(compare)
    return out


def _stat(values, labels, metric, resamples, seed) -> Estimate:
    value, lo, hi = bootstrap(values, labels, metric, resamples=resamples, seed=seed)
    return Estimate(value=value, ci=(lo, hi))


def _subset_metrics(columns: dict[str, np.ndarray], labels: np.ndarray, resamples: int,
                    seed: int) -> dict[str, ScoreMetrics]:
    out = {}
    for name, values in columns.items():
        keep = ~np.isnan(values)
        y = labels[keep]
        if y.sum() == 0 or y.sum() == y.size:
            continue
        out[name] = ScoreMetrics(n=int(keep.sum()), positives=int(y.sum()),
                                 auroc=_stat(values[keep], y, auroc, resamples, seed),
                                 auprc=_stat(values[keep], y, auprc, resamples, seed))
    return out


def metrics(scores: dict, compare: dict, labels: np.ndarray, variants, req) -> Metrics:
    """AUROC and AUPRC with bootstrap intervals for every score, overall and per consequence
    class; paired AUROC differences of the model against the chain, the VCF's scores, the
    baseline model and its own shortest context, on the variants both scored."""

    columns = ranked(scores, compare, req.score)
    overall = _subset_metrics(columns, labels, req.resamples, req.seed)
    classes = {}
    consequence = [v.info.get("CONSEQUENCE") for v in variants]
    if any(c is not None for c in consequence):
        for value in sorted({c for c in consequence if c is not None}, key=str):
            rows = np.array([c == value for c in consequence])
            y = labels[rows]
            if y.sum() >= MIN_CLASS and (y.size - y.sum()) >= MIN_CLASS:
                classes[str(value)] = _subset_metrics({k: v[rows] for k, v in columns.items()}, y,
                                                      req.resamples, req.seed)
    contexts = sorted(set(req.contexts))
    pairs, not_compared = [], []
    for L in contexts:
        model = f"model@{L}"
        for other in ["markov", *compare, f"baseline@{L}" if f"baseline@{L}" in columns else None,
                      f"model@{contexts[0]}" if L != contexts[0] else None]:
            if other is None:
                continue
            keep = ~np.isnan(columns[model]) & ~np.isnan(columns[other])
            positives = int(labels[keep].sum())
            if positives == 0 or positives == int(keep.sum()):  # an AUROC needs both classes
                not_compared.append(f"{model} vs {other}: the {int(keep.sum()):,} variants both scored are all "
                                    f"{'positive' if positives else 'negative'}")
                continue
            diff, lo, hi = paired_difference(columns[model][keep], columns[other][keep], labels[keep], auroc,
                                             resamples=req.resamples, seed=req.seed)
            pairs.append(Difference(a=model, b=other, n=int(keep.sum()), auroc_difference=diff, ci=(lo, hi)))
    positive_class = PositiveClass(label=req.label, positive=list(req.positive),
                                   negative=None if req.negative is None else list(req.negative))
    return Metrics(positive_class=positive_class, overall=overall, by_consequence=classes, differences=pairs,
                   not_compared=not_compared)


def describe(name: str) -> str:
    who, _, context = name.partition("@")
    if context:
        return f"{who} at {size_label(int(context))} of preceding context"
    return {"markov": "the Markov chain"}.get(who, who)


def summary(report: VariantsReport, skipped_list: Path | None = None) -> list[str]:
    """The findings in words; ``skipped_list``: the file that lists the skipped variants."""
    data, m = report.data, report.metrics
    skipped = f"{data.skipped:,} skipped"
    if data.skipped:
        skipped += f": {reasons_in_words(data.skipped_by_reason)}"
        skipped += f"; listed in {skipped_list}" if skipped_list is not None else ""
    lines = [f"{data.variants:,} variants scored ({skipped})"]
    if m is None:
        lines.append("no --label: scores only (variants.tsv), no AUROC")
        return lines
    lines[0] += f"; {data.positives:,} positive, {data.negatives:,} negative"
    for name, entry in m.overall.items():
        a, p = entry.auroc, entry.auprc
        lines.append(f"{describe(name)}: AUROC {a.value:.3f} [{a.ci[0]:.3f}, {a.ci[1]:.3f}], "
                     f"AUPRC {p.value:.3f} [{p.ci[0]:.3f}, {p.ci[1]:.3f}] (n={entry.n:,})")
    for d in m.differences:
        lo, hi = d.ci
        verdict = "above" if lo > 0 else "below" if hi < 0 else "not distinguishable from"
        lines.append(f"{describe(d.a)} is {verdict} {describe(d.b)}: AUROC {d.auroc_difference:+.3f} "
                     f"[{lo:+.3f}, {hi:+.3f}]")
    lines += [f"not compared: {why}" for why in m.not_compared]
    return lines


TSV_FIXED = ("variant", "chrom", "pos", "ref", "alt", "kind", "label")
SKIPPED_TSV = "skipped.tsv"


def tsv_text(variants, labels, scores: dict, compare: dict) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, delimiter="\t", lineterminator="\n")
    columns = [(name, kind) for name in scores for kind in ("sum", "mean")]
    writer.writerow([*TSV_FIXED, *(f"{name} llr_{kind}" for name, kind in columns), *compare])
    for i, v in enumerate(variants):
        label = "" if labels is None else int(labels[i])
        values = [scores[name][kind][i] for name, kind in columns] + [compare[c][i] for c in compare]
        writer.writerow([v.key, v.chrom, v.pos, v.ref, v.alt, v.kind, label,
                         *("" if np.isnan(x) else f"{x:.6g}" for x in values)])
    return buf.getvalue()


def skipped_text(skipped) -> str:
    """One row per skipped VCF allele (``vcf.Skipped``) with the whole reason, its position included."""
    buf = io.StringIO()
    writer = csv.writer(buf, delimiter="\t", lineterminator="\n")
    writer.writerow(["variant", "chrom", "pos", "ref", "alt", "id", "reason"])
    for s in skipped:
        writer.writerow([s.key, s.chrom, s.pos, s.ref, s.alt, s.id or "", s.reason])
    return buf.getvalue()


def roc_figure(columns: dict[str, np.ndarray], labels: np.ndarray, aurocs: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, values in columns.items():
        keep = ~np.isnan(values)
        s, y = values[keep], labels[keep]
        order = np.argsort(-s, kind="stable")
        tpr = np.concatenate([[0], np.cumsum(y[order]) / max(y.sum(), 1)])
        fpr = np.concatenate([[0], np.cumsum(1 - y[order]) / max((1 - y).sum(), 1)])
        ax.plot(fpr, tpr, label=f"{describe(name)} ({aurocs[name]:.3f})")
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title("ROC: positives against the rest (AUROC)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def context_figure(report: VariantsReport):
    import matplotlib.pyplot as plt

    overall = report.metrics.overall
    contexts = report.settings.contexts
    fig, ax = plt.subplots(figsize=(6, 4))
    for who in ("model", "baseline"):
        points = [(L, overall[f"{who}@{L}"].auroc) for L in contexts if f"{who}@{L}" in overall]
        if points:
            x = [p[0] for p in points]
            y = [p[1].value for p in points]
            err = [[v - p[1].ci[0] for p, v in zip(points, y)], [p[1].ci[1] - v for p, v in zip(points, y)]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=who)
    for name in ("markov", *report.settings.compare):
        if name in overall:
            ax.axhline(overall[name].auroc.value, ls="--", lw=1, color="grey")
            ax.annotate(describe(name), (contexts[0], overall[name].auroc.value), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [size_label(L) for L in contexts])
    ax.set_xlabel("preceding context (bases)")
    ax.set_ylabel("AUROC (95% CI)")
    ax.set_title("AUROC by preceding context")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_outputs(report: VariantsReport, variants, labels, scores: dict, compare: dict, out: Path,
                  skipped=()) -> None:
    """variants.json, variants.tsv, skipped.tsv when ``skipped`` (``vcf.Skipped``) has any, and
    with labels roc.png and auroc_by_context.png, each written whole (a temporary file renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    from genome_lm.eval.report import write_figure

    files = {"json": str(out / "variants.json"), "tsv": str(out / "variants.tsv")}
    atomic_write(out / "variants.tsv", tsv_text(variants, labels, scores, compare).encode())
    if skipped:
        atomic_write(out / SKIPPED_TSV, skipped_text(skipped).encode())
        files["skipped"] = str(out / SKIPPED_TSV)
    if report.metrics is not None:
        columns = ranked(scores, compare, report.settings.score)
        longest = max(report.settings.contexts)
        shown = {k: v for k, v in columns.items() if "@" not in k or k.endswith(f"@{longest}")}
        overall = report.metrics.overall
        aurocs = {k: overall[k].auroc.value for k in shown if k in overall}
        write_figure(roc_figure({k: shown[k] for k in aurocs}, labels, aurocs), out / "roc.png")
        write_figure(context_figure(report), out / "auroc_by_context.png")
        files.update(roc=str(out / "roc.png"), by_context=str(out / "auroc_by_context.png"))
    report.files = files
    write_json(report, out / "variants.json")


def log_to_mlflow(report: VariantsReport, out: Path, lm, tracking_uri: str | None, note,
                  started: float) -> MlflowInfo | None:
    """A run in the training run's store and experiment (its child when the model is one), else
    a store in ``out``: the settings, AUROC/AUPRC per score and the files."""

    cfg = lm.config
    run_dir = lm.run_dir if lm.run_dir is not None else out
    uri = tracking_uri or (cfg.tracking.uri if cfg is not None else None)
    experiment = cfg.tracking.experiment if cfg is not None else "genome-lm"
    name = f"variants {Path(report.settings.vcf).name}"
    with Tracker(uri, experiment=experiment, run_name=name, run_dir=run_dir,
                 start_time_ms=int(started * 1000)) as tracker:
        if not tracker.active:
            note("MLflow: tracking unavailable; the report files are complete without it")
            return None
        tags = {"genome_lm.kind": "variants", "genome_lm.variants_schema": report.schema}
        if lm.run_id:
            tags.update({"mlflow.parentRunId": lm.run_id, "genome_lm.training_run": lm.run_id})
        tracker.set_tags(tags)
        data = {k: v for k, v in to_json(report.data).items() if k != "skipped_variants"}
        tracker.log_params({"settings": to_json(report.settings), "models": to_json(report.models), "data": data})
        if report.metrics is not None:
            flat = {}
            for score, entry in report.metrics.overall.items():
                key = score.replace("@", "_at_")
                flat[f"variants/{key}/auroc"] = entry.auroc.value
                flat[f"variants/{key}/auprc"] = entry.auprc.value
            tracker.log_metrics(flat)
        for path in report.files.values():
            tracker.log_artifact(path)
        return MlflowInfo(**tracker.info())
