"""``genome-lm variants``: zero-shot variant effect scores of a VCF (genome_lm.variants)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from genome_lm.variants.run import VariantRequest, run_variants

from .base import app, console, size, sizes


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


@app.command()
def variants(
    vcf: Annotated[Path, typer.Option(help="The variants: VCF or bgzip VCF (multi-allelic records are split).")],
    fasta: Annotated[Path, typer.Option(help="The reference the VCF's coordinates are on (plain or bgzip FASTA; "
                                             "indexed if it has no .fai).")],
    model: Annotated[str, typer.Option(help="A training run folder, a checkpoint, a Hugging Face folder, "
                                            "builtin:tiny-long or preset:NAME.")],
    out: Annotated[Path, typer.Option(help="Folder for variants.json, variants.tsv, skipped.tsv and the plots.")] = (
        Path("variants")),
    baseline: Annotated[Optional[str], typer.Option(help="A second model scored the same way ('init': the model's "
                                                         "starting weights).")] = None,
    contexts: Annotated[str, typer.Option(help="Preceding context lengths to score every variant at, e.g. "
                                               "'256,1k,4k,16k'.")] = "4k",
    right: Annotated[str, typer.Option(help="Following context after the variant (bases); with 4k before, the field's "
                                            "8,192-base window.")] = "4095",
    rc: Annotated[bool, typer.Option("--rc/--no-rc", help="Also score the reverse strand (the same context lengths "
                                                          "read on it) and average.")] = False,
    score: Annotated[str, typer.Option(help="The ratio the metrics rank by: sum (log-likelihood ratio over the "
                                            "positions the variant changes) or mean (per position).")] = "sum",
    max_indel: Annotated[int,
                         typer.Option(help="Longest insertion or deletion scored (bases); longer ones are skipped.",
                                      min=0)] = 50,
    label: Annotated[Optional[str], typer.Option(help="INFO field with the class (e.g. FUNC_CLASS); without it only "
                                                      "the scores are written.")] = None,
    positive: Annotated[Optional[str], typer.Option(help="Values of --label that are positive (damaging), e.g. LOF or "
                                                         "pathogenic,likely_pathogenic.")] = None,
    negative: Annotated[Optional[str], typer.Option(help="Values of --label that are negative; default: every other "
                                                         "value.")] = None,
    compare: Annotated[Optional[str], typer.Option(help="INFO fields with other methods' scores to put beside the "
                                                        "model (higher = more damaging), e.g. CADD,PHYLOP.")] = None,
    strict: Annotated[bool, typer.Option(help="A variant that cannot be scored (REF mismatch, N or the record's end in "
                                              "its window) is an error instead of skipped.")] = False,
    chunk: Annotated[str, typer.Option(help="Chunked prefill of the preceding context: tokens per forward chunk ('0': "
                                            "all at once).")] = "0",
    max_variants: Annotated[Optional[int], typer.Option(help="Score only the first N variants (a quick look).",
                                                        min=1)] = None,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples for the 95% intervals.", min=10)] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap.")] = 0,
    tracking_uri: Annotated[Optional[str], typer.Option(help="MLflow store; default: the training run's, else "
                                                             "OUT/mlflow.db.")] = None,
    tracking: Annotated[bool, typer.Option(help="Log the report to MLflow (a child of the training run when the model "
                                                "is one).")] = True,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Zero-shot variant effects: how much less likely the model finds each variant's allele.

    For every SNV and short indel of the VCF and every preceding context L in --contexts, the model reads L bases before
    the variant, the allele and --right bases after it, once with the reference allele and once with the alternative;
    the score is the log-likelihood ratio (alternative minus reference) over the positions the variant can change. The
    context before the variant is run once per site and shared by its alleles.

    With --label and --positive: AUROC and AUPRC with 95% bootstrap intervals for the model at each context, the order-k
    Markov chain fitted on the FASTA, the --compare fields and the --baseline model, overall and per CONSEQUENCE class,
    with paired intervals on the differences. Writes variants.json (schema genome-lm.variants/1), variants.tsv (one row
    per variant), roc.png and auroc_by_context.png, and an MLflow run.

    Skipped variants (REF not matching the FASTA, N or the record's end inside the window, long indels, symbolic
    alleles) are counted and listed in the report and in skipped.tsv (one row each with its reason).
    """

    chunk_size = 0 if chunk.strip() in ("0", "none") else size(chunk, "--chunk")
    request = VariantRequest(
        vcf=vcf, fasta=fasta, model=model, out=out, baseline=baseline, contexts=sizes(contexts, "--contexts"),
        right=0 if right.strip() == "0" else size(right, "--right"), rc=rc, score=score, max_indel=max_indel,
        label=label, positive=_names(positive), negative=_names(negative) if negative else None,
        compare=_names(compare), strict=strict, chunk=chunk_size or None, max_variants=max_variants,
        resamples=resamples, seed=seed, tracking=tracking, tracking_uri=tracking_uri)
    report = run_variants(request, progress=not quiet, on_note=lambda t: console.print(t, highlight=False))
    print_report(report)


def print_report(report) -> None:
    """The AUROC/AUPRC table, the summary and where the files are (``report``: a VariantsReport)."""
    data, m = report.data, report.metrics
    if m is not None:
        table = Table(title=f"AUROC / AUPRC [95% CI], {data.positives:,} positive and {data.negatives:,} "
                            "negative variants", title_justify="left")
        for col in ("score", "n", "AUROC", "AUPRC"):
            table.add_column(col, justify="left" if col == "score" else "right")
        from genome_lm.variants.report import describe

        for name, e in m.overall.items():
            a, p = e.auroc, e.auprc
            table.add_row(describe(name), f"{e.n:,}", f"{a.value:.3f} [{a.ci[0]:.3f}, {a.ci[1]:.3f}]",
                          f"{p.value:.3f} [{p.ci[0]:.3f}, {p.ci[1]:.3f}]")
        console.print(table)
    for line in report.summary:
        console.print(line, highlight=False)
    for what, path in report.files.items():
        console.print(f"{what}: {path}", highlight=False)


@app.command("probe")
def probe_command(
    vcf: Annotated[Path, typer.Option(help="The variants: VCF or bgzip VCF, labelled by an INFO field (--label).")],
    fasta: Annotated[Path, typer.Option(help="The reference the VCF's coordinates are on.")],
    model: Annotated[str, typer.Option(help="A training run folder, a checkpoint, a Hugging Face folder, or "
                                            "builtin:tiny-long: its embeddings are the probe's features.")],
    out: Annotated[Path, typer.Option(help="Folder for probe.json (the fitted probe), probe.tsv (each variant's "
                                           "out-of-fold scores) and probe-report.json.")],
    label: Annotated[Optional[str], typer.Option(help="INFO field with the class (e.g. FUNC_CLASS).")] = None,
    positive: Annotated[Optional[str], typer.Option(help="Values of --label that are positive, e.g. LOF.")] = None,
    negative: Annotated[Optional[str], typer.Option(help="Values of --label that are negative; default: every "
                                                         "other value.")] = None,
    layers: Annotated[str, typer.Option(help="Layers whose embeddings are features: indices from 0 (negative from "
                                             "the end) or 'final'.")] = "final",
    contexts: Annotated[str, typer.Option(help="Preceding contexts to embed each variant at, e.g. 1k,8k.")] = "1k",
    right: Annotated[int, typer.Option(help="Bases after the allele whose hidden states are averaged.",
                                       min=0)] = 64,
    folds: Annotated[int, typer.Option(help="Cross-validation folds, grouped by genomic blocks.", min=2)] = 5,
    block: Annotated[str, typer.Option(help="Variants within one block of this many bases go to the same "
                                            "fold.")] = "1k",
    compare: Annotated[Optional[str], typer.Option(help="INFO fields with other methods' scores to put beside the "
                                                        "probe (higher = more damaging), e.g. CADD.")] = None,
    apply: Annotated[Optional[Path], typer.Option(help="A probe.json from an earlier run with the same model: score "
                                                       "this VCF with it instead of fitting one.",
                                                  show_default=False)] = None,
    chunk: Annotated[str, typer.Option(help="Chunked prefill of the preceding context ('0': one forward).")] = "32k",
    max_variants: Annotated[Optional[int], typer.Option(help="Only the first N variants (a quick look).",
                                                        min=1)] = None,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples for the 95% intervals.", min=10)] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the regression and the bootstrap.")] = 0,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """A supervised variant-effect probe: a regularized logistic regression on the model's
    embeddings around each variant (reference, alternative and their difference, per layer and
    preceding context) plus its position and consequence class, cross-validated with folds grouped
    by genomic blocks so that neighbouring variants never straddle training and test. Reports the
    out-of-fold AUROC and AUPRC with 95% intervals beside position + consequence alone and the
    --compare fields, and saves the probe fitted on every variant (--apply scores another VCF)."""
    from genome_lm.variants.probe import ProbeRequest, run_probe

    chunk_size = 0 if chunk.strip() in ("0", "none") else size(chunk, "--chunk")
    req = ProbeRequest(vcf=vcf, fasta=fasta, model=model, out=out, layers=layers,
                       contexts=tuple(sizes(contexts, "--contexts")), right=right, label=label,
                       positive=_names(positive), negative=_names(negative) if negative else None,
                       compare=_names(compare), apply=apply, folds=folds, block=size(block, "--block"),
                       chunk=chunk_size or None, max_variants=max_variants, resamples=resamples, seed=seed)
    report = run_probe(req, progress=not quiet)
    console.print(f"{report['variants']:,} variants; wrote {out}/probe.tsv, probe-report.json"
                  + ("" if apply else ", probe.json"), highlight=False, soft_wrap=True)
    for name, m in report.get("metrics", {}).items():
        a, p = m["auroc"], m["auprc"]
        for line in (f"  {name} (n={m['n']:,}):", f"    AUROC {a['value']:.3f} [{a['lo']:.3f}, {a['hi']:.3f}], "
                     f"AUPRC {p['value']:.3f} [{p['lo']:.3f}, {p['hi']:.3f}]"):  # 80 columns piped
            console.print(line, highlight=False, soft_wrap=True)
