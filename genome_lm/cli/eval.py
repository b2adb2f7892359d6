"""Evaluation commands: ``eval``, ``check-logprobs`` and ``recall`` (genome_lm.eval does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from genome_lm.data.names import canonical
from genome_lm.data.windows import MAX_N_FRACTION
from genome_lm.errors import GenomeLMError
from genome_lm.eval.buckets import units_text
from genome_lm.eval.schema import SUBSETS, Change, EvalReport, Stat

from .base import app, console, size, sizes


def _fmt_ci(stat: Stat, unit: str = "nats") -> str:
    value, (lo, hi) = getattr(stat, unit), getattr(stat, f"{unit}_ci")
    if value is None:
        return "-"
    ci = f" [{lo:.4f}, {hi:.4f}]" if lo is not None else ""
    return f"{value:.4f}{ci}"


def _fmt_change(change: Change | None) -> str:
    if change is None or change.change is None:
        return "-"
    lo, hi = change.ci
    ci = f" [{lo * 100:+.1f}, {hi * 100:+.1f}]" if lo is not None else ""
    return f"{change.change * 100:+.2f}%{ci}"


def print_report(report: EvalReport, out: Console | None = None) -> None:
    """The terminal table: loss per context bucket (nats per base, 95% CI over windows), per
    model, the change against the baseline, then overall / unmasked / soft-masked rows."""
    from genome_lm.eval.planted import by_distance_line, verdict
    from genome_lm.eval.report import headline

    out = out or console
    results, comparison, data = report.results, report.comparison, report.data
    table = Table(title=f"{data.chrom} ({data.split}): loss in nats/base by preceding context, "
                        f"{len(data.windows)} windows of up to {data.window_length:,}, {data.tokens:,} tokens "
                        f"(N excluded); [95% CI over {units_text(report)}]", title_justify="left")
    table.add_column("context", justify="right")
    table.add_column("tokens", justify="right")
    for name in results:
        table.add_column(name, justify="right")
    if comparison:
        table.add_column("change", justify="right")
    names = list(results)
    first = results[names[0]]
    for i, b in enumerate(first.buckets):
        if not b.tokens:
            continue
        row = [f"{b.start:,}-{b.end - 1:,}", f"{b.tokens:,}"]
        row += [_fmt_ci(results[n].buckets[i]) for n in names]
        if comparison:
            row.append(_fmt_change(comparison.buckets[i]))
        table.add_row(*row)
    for subset in SUBSETS:
        row = [subset, f"{getattr(first, subset).tokens:,}"] + [_fmt_ci(getattr(results[n], subset)) for n in names]
        if comparison:
            row.append(_fmt_change(getattr(comparison, subset)))
        table.add_row(*row, style="bold" if subset == "all" else None)
    out.print(table)
    bits = ", ".join(f"{n} {results[n].all.bits:.4f}" for n in names if results[n].all.bits is not None)
    out.print(f"bits per base: {bits}", highlight=False)
    for line in headline(report):
        out.print(line, highlight=False)
    if report.ablation:
        _print_ablation(report, out)
    if report.planted:
        for name in report.planted.models:
            out.print(verdict(report.planted, name), highlight=False)
            if (line := by_distance_line(report.planted, name)) is not None:
                out.print(line, highlight=False, markup=False)  # its [intervals] are not markup
    if report.files:
        out.print("wrote " + ", ".join(report.files.values()), highlight=False)
    if report.mlflow and report.mlflow.location:
        out.print(f"MLflow: {report.mlflow.location}", highlight=False)


def _print_ablation(report: EvalReport, out: Console) -> None:
    from genome_lm.eval.ablation import fmt_delta_ci, most_hurt

    cuts = report.ablation.cuts
    table = Table(title="context ablation: loss(context cut to N) - loss(whole window), nats/base [95% CI over "
                        f"{units_text(report)}]", title_justify="left")
    table.add_column("context", justify="right")
    # (header, entry of a cut): the model's; with a baseline also the baseline's and their difference
    columns = []
    for cut in cuts:
        N = f"{cut.max_context:,}"
        columns.append((f"cut to {N}", cut))
        if cut.gain:
            columns += [(f"baseline cut to {N}", cut.baseline), ("model - baseline", cut.gain)]
    for header, _ in columns:
        table.add_column(header, justify="right")
    for i, b in enumerate(cuts[0].buckets):
        if b.tokens:
            table.add_row(f"{b.start:,}-{b.end - 1:,}", *(fmt_delta_ci(c.buckets[i]) for _, c in columns))
    table.add_row("all", *(fmt_delta_ci(c.all) for _, c in columns), style="bold")
    out.print(table)
    for line in most_hurt(report.ablation):
        out.print(line, highlight=False)


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Option(help="The model: a training run folder (its latest checkpoint), a checkpoint "
                                            "folder, a Hugging Face glm5_next folder, or builtin:tiny-long (the "
                                            "shipped long-context model).")],
    chrom: Annotated[Optional[str], typer.Option(help="Chromosome or region to evaluate (chr22, 22 and NC_000022.11 "
                                                      "all match; a region such as chr2:1,800,001-2,333,275 takes the "
                                                      "windows wholly inside it); default: every window of the "
                                                      "split.")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="A second model scored on the same tokens (same kinds as "
                                                         "--model, or 'init': the run's starting weights); the report "
                                                         "gives the relative change per bucket.")] = None,
    dataset: Annotated[Optional[Path],
                       typer.Option(help="A prepared dataset folder; default: the run's data.dataset.")] = None,
    fasta: Annotated[Optional[Path], typer.Option(help="Evaluate straight from a genome FASTA: --chrom is prepared "
                                                       "into OUT/prepared first.")] = None,
    window: Annotated[str, typer.Option(help="With --fasta: window length (512k, 1M).")] = "512k",
    split: Annotated[str, typer.Option(help="Split of the dataset to evaluate.")] = "eval",
    buckets: Annotated[Optional[str], typer.Option(help="Context buckets: edges '0,1k,4k,64k' (the window length is "
                                                        "added), or 'pow2:1k' (0, then powers of two from 1k). "
                                                        "Default: pow2:1k up to the window length.")] = None,
    chunk: Annotated[str, typer.Option(help="Chunked prefill: tokens per forward chunk (memory stays bounded whatever "
                                            "the window); '0' scores each window in one forward.")] = "32k",
    max_windows: Annotated[Optional[int], typer.Option(help="Score at most this many windows, evenly spaced over the "
                                                            "chromosome.", min=1)] = None,
    max_n: Annotated[float, typer.Option(help="Skip windows with more than this fraction of N.")] = MAX_N_FRACTION,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples over windows for the 95% intervals.",
                                           min=10)] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap.")] = 0,
    planted: Annotated[Optional[Path], typer.Option(help="Planted-copies JSON (demo genome); default: the FASTA name "
                                                         "with .planted.json for .fa (demo.fa -> demo.planted.json), "
                                                         "beside the dataset's FASTA, when present.")] = None,
    max_context: Annotated[Optional[str], typer.Option(help="Context ablation: score the model again with every base "
                                                            "seeing at most N preceding tokens (the window in N-token "
                                                            "segments, each from scratch), e.g. '1k,4k'; the report "
                                                            "gives loss(cut) - loss(whole window) per bucket with "
                                                            "intervals.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Output folder for eval.json, eval.csv and the plots; default: "
                                                     "RUN/eval-CHROM or ./eval.")] = None,
    tracking_uri: Annotated[Optional[str], typer.Option(help="MLflow store; default: the training run's store (its run "
                                                             "folder's mlflow.db).")] = None,
    tracking: Annotated[bool, typer.Option(help="Log the evaluation to MLflow as a child of the training run.")] = True,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="The parallel layout over many ranks: --set "
                                                                    "parallel.tp=2 (tp, cp, ep, etp, pp, "
                                                                    "sequence_parallel; repeatable). Default: the "
                                                                    "training run's layout when the ranks can hold it, "
                                                                    "else data parallel over windows.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Score on a Ray cluster ('auto', host:port, or 'local' to "
                                                            "start one here).")] = None,
    workers: Annotated[int, typer.Option(help="With --ray-address: ranks to start (one GPU each, or CPU workers "
                                              "without GPUs).", min=1)] = 1,
    cpus_per_worker: Annotated[int, typer.Option(help="With --ray-address: CPUs reserved per rank.", min=1)] = 1,
) -> None:
    """Loss by preceding-context length on an evaluation chromosome, optionally against a baseline.

    Scores every non-N base of the chromosome's windows (each window from its first base, so a base's context is its
    offset in the window), in nats and bits per base, overall and apart for soft-masked and unmasked bases, and groups
    them by context length (powers of two up to the window length) with 95% bootstrap intervals over windows. With
    --baseline the same tokens are scored by a second model and the relative change is reported per bucket.

    Each window's scores are kept in OUT/.scores (OUT the --out folder) as soon as it is scored: an interrupted
    evaluation re-run with the same arguments scores only the windows it had not (delete the folder to free the space).

    With --max-context N[,N...] the model is also scored with its context cut to N (a context ablation: one model
    against itself, so no second model is needed), reported per bucket as the loss difference with a paired interval and
    drawn in context_ablation.png.

    Writes eval.json (schema genome-lm.eval/1), eval.csv and loss_by_context.png, and logs them to MLflow next to the
    training run. On the demo genome it also compares the loss on planted later copies whose first copy lies inside the
    window with those whose first copy lies outside it.

    Over many ranks (--ray-address with --workers, or torchrun --nproc-per-node N -m genome_lm eval ...) tensor and
    context parallel split each window's forward, expert parallel the MoE layers, pipeline parallel the layers, and data
    parallel shares out the windows; rank 0 writes the same report. A split model scores each window in one forward
    (--chunk applies to unsplit ranks).
    """
    from genome_lm.checkpoint.paths import is_run_folder
    from genome_lm.eval.evaluate import EvalRequest, evaluate

    chunk_size = 0 if chunk.strip() in ("0", "none") else size(chunk, "--chunk")
    if out is None:
        run = Path(model)
        tag = f"eval-{folder_name(chrom)}" if chrom else "eval"
        out = run / tag if is_run_folder(run) else Path(tag)
    request = EvalRequest(model=model, out=out, baseline=baseline, dataset=dataset, fasta=fasta, chrom=chrom,
                          split=split, window=size(window, "--window"), bucket_text=buckets, chunk=chunk_size or None,
                          max_windows=max_windows, max_n_fraction=max_n, resamples=resamples, seed=seed,
                          planted=planted, max_contexts=sizes(max_context, "--max-context") if max_context else None,
                          tracking=tracking, tracking_uri=tracking_uri, layout=parallel_layout(set_))
    try:
        if ray_address is not None:
            from genome_lm.eval.evaluate import eval_on_ray

            report = eval_on_ray(request, address=ray_address, workers=workers, cpus_per_worker=cpus_per_worker,
                                 progress=not quiet)
        else:
            report = evaluate(request, progress=not quiet, on_note=lambda t: console.print(t, highlight=False))
    except KeyboardInterrupt:
        scores = Path(out) / ".scores"
        kept = len(list(scores.glob("*/window-*.npy"))) if scores.is_dir() else 0
        Console(stderr=True).print(
            f"interrupted: the {kept} windows scored so far are kept in {scores} and will be reused when you run the "
            "same command again", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    if report is not None:  # under torchrun, rank 0 reports
        print_report(report)


def folder_name(chrom: str) -> str:
    """The default output folder's name for ``--chrom``: the same for every spelling of a human
    chromosome (22, chr22, NC_000022.11 -> chr22), so a second eval finds the first one's scores;
    any other name or region as typed."""
    key = canonical(chrom)
    return f"chr{key}" if key.isdigit() or key in ("X", "Y", "M") else chrom


def parallel_layout(items: list[str] | None) -> dict | None:
    """``--set parallel.tp=2 ...`` -> the fields of ``ParallelSizes`` (parsed and validated as the
    training config's parallel section), or None when none is given."""
    if not items:
        return None
    from genome_lm.config import load_config

    for item in items:
        if not item.strip().startswith("parallel."):
            raise GenomeLMError(f"--set {item!r}: eval takes parallel.<field>=<value> (tp, cp, ep, etp, pp, "
                                "sequence_parallel)")
    section = load_config(None, items).parallel
    return {k: getattr(section, k) for k in ("tp", "cp", "ep", "etp", "pp", "sequence_parallel")}


@app.command("check-logprobs")
def check_logprobs_command(
    model: Annotated[str, typer.Option(help="A training run, checkpoint or Hugging Face glm5_next folder, or "
                                            "preset:tiny (fresh seeded weights).")],
    lengths: Annotated[str,
                       typer.Option(help="Comma-separated context lengths (k=1024); one sequence each.")] = "1k,4k,16k",
    chunk: Annotated[str, typer.Option(help="Tokens per chunk of the chunked-prefill path.")] = "4k",
    threshold: Annotated[Optional[float], typer.Option(help="Largest allowed max |delta logprob|; default 1e-4 for "
                                                            "fp32 models, 0.1 for bf16.")] = None,
    paths: Annotated[str, typer.Option(help="Inference paths to compare: prefill, transformers, vllm (those that "
                                            "cannot run here are reported as not run).")] = "prefill,transformers,vllm",
    dataset: Annotated[Optional[Path], typer.Option(help="Score the start of this dataset's longest evaluation window "
                                                         "instead of random DNA.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random DNA (and of preset weights).")] = 0,
) -> None:
    """Compare per-token log-probabilities of the training forward with independent inference paths.

    The same tokens go through the training forward and through genome-lm's chunked prefill (carried KDA state, cached
    DSA keys), transformers' glm5_next (a Hugging Face model, when installed) and vLLM (when installed on a GPU). Prints
    mean and max |delta logprob| of the realised next token per context length and exits with status 1 when any path
    exceeds --threshold. On CPU in fp32 the prefill path stays below 1e-4.
    """
    from genome_lm.eval.probes.logprobs import check_logprobs

    lengths_ = sizes(lengths, "--lengths")
    wanted = tuple(x.strip() for x in paths.split(",") if x.strip())

    def show(row):
        console.print(f"{row.path} T={row.length:,}: mean |d logprob| {row.mean_abs:.3g}, max {row.max_abs:.3g}",
                      highlight=False)

    rows, limit = check_logprobs(model, lengths_, chunk=size(chunk, "--chunk"), threshold=threshold, seed=seed,
                                 dataset=dataset, paths=wanted, progress=show)
    table = Table(title=f"training forward vs inference paths: |delta log p(next token)| ({model})",
                  title_justify="left")
    for column in ("path", "T", "mean |d logprob|", "max |d logprob|", f"<= {limit:g}", "note"):
        table.add_column(column, justify="left" if column in ("path", "note") else "right")
    for r in rows:
        ok = "" if r.passed is None else ("yes" if r.passed else "[bold red]NO[/]")
        table.add_row(r.path, f"{r.length:,}", "" if r.mean_abs is None else f"{r.mean_abs:.3g}",
                      "" if r.max_abs is None else f"{r.max_abs:.3g}", ok, r.note)
    console.print(table)
    failed = [f"{r.path} T={r.length:,}" for r in rows if r.passed is False]
    if failed:
        Console(stderr=True).print(f"[bold red]log-probabilities differ[/] above {limit:g}: {', '.join(failed)}")
        raise typer.Exit(1)
    ran = sorted({r.path for r in rows if r.passed})
    console.print(f"every path that ran ({', '.join(ran)}) agrees within {limit:g}", highlight=False)


@app.command("recall")
def recall_command(
    model: Annotated[str, typer.Option(help="A training run, checkpoint or Hugging Face folder, preset:tiny, or "
                                            "builtin:tiny-long (the shipped long-context model).")],
    dataset: Annotated[Optional[Path], typer.Option(help="Draw segments and background from this dataset's evaluation "
                                                         "split (N-free stretches); default: the run's data.dataset, "
                                                         "else random DNA.")] = None,
    distances: Annotated[Optional[str], typer.Option(help="Comma-separated distances d (k=1024), instead of the "
                                                          "default sweep.")] = None,
    max_distance: Annotated[Optional[str], typer.Option(help="End the sweep 64, 256, 1k, ... (x4) at this distance "
                                                             "instead of at the model's window. Default: the largest d "
                                                             "whose probe (64 lead + 2 x segment + d bases) fits the "
                                                             "window: the run's longest data.seq_len (with its "
                                                             "warm-up), else the --dataset's window length, else 4k "
                                                             "when neither is known. Long distances are slow on a CPU "
                                                             "(every trial scores two sequences as long as the probe, "
                                                             "with the full model); lower this or use --distances for "
                                                             "a quick look.")] = None,
    trials: Annotated[int, typer.Option(help="Trials (segment, background draws) per distance.", min=2)] = 8,
    segment: Annotated[int, typer.Option(help="Length of the copied segment in bases.", min=8)] = 256,
    chunk: Annotated[str, typer.Option(help="Chunked prefill above this many tokens.")] = "32k",
    seed: Annotated[int, typer.Option(help="Seed of the draws and the bootstrap.")] = 0,
    recall_bench: Annotated[bool, typer.Option(help="Also run recall-bench's own sweep through its CallableModel (when "
                                                    "installed; it skips distances whose power-of-two probe exceeds "
                                                    "the window).")] = True,
    max_seconds: Annotated[float, typer.Option(help="Time budget: stop before a distance predicted to end past it "
                                                    "(from the last distance's time), and run recall-bench only with "
                                                    "time left. 0: no limit.", min=0)] = 120,
    out: Annotated[Path, typer.Option(
        help="JSON file for the results, rewritten as each distance finishes.")] = Path("recall.json"),
) -> None:
    """Long-range recall probe: the copy advantage CE(control) - CE(repeat) per distance.

    A segment of real (or demo) sequence is repeated after d bases of background; the control puts another segment in
    the first copy's place. The loss on the final segment in both gives the copy advantage in nats per base, with a 95%
    bootstrap interval over trials. By default d runs from 64 up to the model's window length (64, 256, 1k, ... then the
    largest d whose probe fits the window), within --max-seconds (2 minutes: the distances it leaves out are named, with
    how to run them). Each distance is printed and written to --out as it finishes. When recall-bench is installed its
    own sweep runs too, through its CallableModel interface, with background from the same sequence; both are printed
    and written to --out.
    """
    from genome_lm.eval.ablation import fmt_delta
    from genome_lm.eval.probes.recall import recall_bench_available, run_recall

    def finished(row) -> None:
        console.print(f"d={row.distance:,}: copy advantage {fmt_delta(row.advantage)} nats/base "
                      f"[{fmt_delta(row.ci_low)}, {fmt_delta(row.ci_high)}] (CE repeat {row.ce_repeat:.4f}, "
                      f"control {row.ce_control:.4f}); {out} updated", highlight=False)

    try:
        found = run_recall(model, out, dataset=dataset, distances=sizes(distances,
                                                                        "--distances") if distances else None,
                           max_distance=size(max_distance, "--max-distance"), trials=trials, segment=segment,
                           chunk=size(chunk, "--chunk"), seed=seed, recall_bench=recall_bench,
                           max_seconds=max_seconds, say=lambda t: console.print(t, highlight=False, soft_wrap=True),
                           on_row=finished)
    except ValueError as exc:
        raise GenomeLMError(f"{dataset or model}: {exc}") from None
    rows, bench, source = found.rows, found.bench, found.source
    table = Table(title=f"copy advantage CE(control) - CE(repeat), nats/base, {segment}-base segment, {trials} trials "
                        f"({model}; {'dataset ' + str(source) if source else 'random DNA'})", title_justify="left")
    for column in ("distance", "CE repeat", "CE control", "advantage [95% CI]", "recall-bench"):
        table.add_column(column, justify="right")
    by_d = {r["dist"]: r for r in bench or []}
    for r in rows:
        rb_row = by_d.get(r.distance)
        rb_text = ("not installed" if not recall_bench_available() else "skipped" if bench is None else (
            f"{fmt_delta(rb_row['copy_advantage'])} +- {abs(rb_row['stderr']):.2e}"
            if rb_row and rb_row.get("status") == "ok"
            else (rb_row or {}).get("status", "-")))
        table.add_row(f"{r.distance:,}", f"{r.ce_repeat:.4f}", f"{r.ce_control:.4f}",
                      f"{fmt_delta(r.advantage)} [{fmt_delta(r.ci_low)}, {fmt_delta(r.ci_high)}]", rb_text)
    console.print(table)
    console.print(f"wrote {out}", highlight=False)
