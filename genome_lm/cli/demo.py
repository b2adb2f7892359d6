"""``genome-lm demo``: the study end to end on the built-in demo genome (genome_lm.demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from genome_lm.data.regions import split_regions
from genome_lm.demo import DEMO_CONFIG, DNA_CONFIG, run_demo, run_dna_demo, run_long_demo
from genome_lm.errors import GenomeLMError
from genome_lm.folds import compare_recipes, pair_recipes, read_folds, run_folds

from .base import app, console, size
from .data import print_dataset_summary
from .eval import print_report
from .train import print_training


@app.command()
def demo(
    out: Annotated[Optional[Path], typer.Option(help="Folder for the demo's genome and dataset (default data/demo, "
                                                     "with --long data/long).")] = None,
    window: Annotated[str, typer.Option(help="Window length for the demo dataset.")] = "32k",
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    config: Annotated[str, typer.Option(help="Training config (name in configs/ or a path); demo-cpu trains from "
                                             "random weights instead of the shipped long-context model.")
                      ] = DEMO_CONFIG,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a training field (repeatable).")] = None,
    eval_windows: Annotated[int, typer.Option(help="Evaluation windows of chr22 to score (each model), evenly spaced; "
                                                   "with --fasta every held-out window is scored.")] = 8,
    long: Annotated[bool, typer.Option("--long", help="Run the long-context recipe instead (about 25 minutes on 2 "
                                                      "cores): stage 1 learns to copy on a copy drill, stage 2 trains "
                                                      "on a demo genome with dense planted copies; eval cuts the "
                                                      "context to 256 and 1,024 bases to show what the rest adds. "
                                                      "--set applies to stage 2.")] = False,
    fasta: Annotated[Optional[Path], typer.Option(help="Run the study on your own genome instead of the demo genome "
                                                       "(FASTA, plain, gzip or BGZF; soft-masked repeats are reported "
                                                       "apart): needs --train and --eval. Default folder data/dna, "
                                                       "config dna-finetune-cpu.")] = None,
    train: Annotated[Optional[str], typer.Option(help="With --fasta: chromosomes or regions to fine-tune on, "
                                                      "comma-separated, e.g. chr2:1-1,833,275.")] = None,
    eval_region: Annotated[Optional[str], typer.Option("--eval", help="With --fasta: the held-out chromosome or region "
                                                                       "to evaluate on, e.g. chr2:1,833,276-2,333,275 "
                                                                       "(must not overlap --train).")] = None,
    folds: Annotated[Optional[int], typer.Option(help="With --fasta and --region: the k-fold study. The region is cut "
                                                      "into K contiguous folds; each is held out once while the model "
                                                      "is tuned on the others (less a guard band of one window on each "
                                                      "side), so every base is held out exactly once; the report pools "
                                                      "the folds and says which findings hold in every fold. Default "
                                                      "folder data/folds.", min=2)] = None,
    region: Annotated[Optional[str], typer.Option(help="With --folds: the chromosome or region to cut into folds, "
                                                       "e.g. chr2 or chr2:1-2,333,275.")] = None,
    drill: Annotated[float, typer.Option(help="With --fasta: mix the copy drill (random sequence where most bases "
                                              "repeat something up to 16 kbp back, the long recipe's teacher of "
                                              "copying) into fine-tuning as this fraction of the sequences, e.g. 0.2; "
                                              "the Markov chain and the evaluation read your genome only.",
                                         min=0.0, max=0.9)] = 0.0,
) -> None:
    """Run the study end to end on the built-in demo genome, on this CPU.

    demo genome -> prepare (chr1, chr2 train; chr22 eval) -> fine-tune the tiny model (config demo-finetune-cpu: from
    the shipped model that the long-context recipe, --long, trained to copy from earlier in the sequence; tracked in
    MLflow) -> `genome-lm eval` of the tuned against the starting model on the same chr22 windows: loss by
    preceding-context length with 95% intervals, the same model with its context cut to 256 bases (what the rest of the
    window adds), and the loss on planted later copies whose first copy lies inside the window against those whose first
    copy lies outside it. The report goes to OUT/run/eval-chr22 and to MLflow.

With --fasta FILE --train REGIONS --eval REGION the same study runs on your own genome (about 28 minutes on 2 cores for
1.8 Mbp of training): the shipped model fine-tuned on whole windows of the training regions, then the held-out region
scored in windows that start every quarter window (each base at four context lengths) against its starting weights, the
Markov chain fitted on the training regions, and both models with their context cut to 1,024 bases, with a summary in
words. The report goes to OUT/run/eval.

With --fasta FILE --folds K --region R the study runs K times, each fold of R held out once (OUT/fold-1 ... OUT/fold-K,
each the study above, about 28 minutes on 2 cores for the chr2 piece), then pools them: OUT/folds.json gives every
fold's figures, the pooled ones (intervals stratified by fold) and, for each finding, the folds where it holds. Run the
same command again to finish an interrupted study: done folds are read back, the interrupted one continues."""
    if long:
        _long_demo(out or Path("data/long"), quiet, set_ or [], eval_windows)
        return
    if folds is not None or region is not None:
        _folds_demo(fasta, folds, region, train, eval_region, out or Path("data/folds"), size(window, "--window"),
                    quiet, config if config != DEMO_CONFIG else DNA_CONFIG, set_ or [], drill)
        return
    if fasta is not None or train is not None or eval_region is not None:
        _dna_demo(fasta, train, eval_region, out or Path("data/dna"), size(window, "--window"), quiet,
                  config if config != DEMO_CONFIG else DNA_CONFIG, set_ or [], drill)
        return
    out = out or Path("data/demo")
    result = run_demo(out, size(window, "--window"), config=config, overrides=set_, eval_windows=eval_windows,
                      progress=not quiet, on_dataset=lambda p: print_dataset_summary(p.manifest, reused=p.reused),
                      on_trained=_print_stage)
    report = result.report
    print_report(report, console)
    console.print(f"(the model: checkpoint {report.models['model'].path})", highlight=False)
    print_verdict(report)


def _print_stage(trained) -> None:
    """A training stage's summary; one a signal stopped continues when the demo is run again."""
    print_training(trained, to_continue="run the same command again to continue")


def print_verdict(report) -> None:
    """The demo's closing lines: what it measured, each figure with its sign (eval.verdict)."""
    from genome_lm.eval.verdict import demo_verdict

    console.print(f"[bold]what this demo measured[/bold] (the tuned model on {report.data.chrom}; "
                  "[95% intervals])", highlight=False)
    for line in demo_verdict(report):
        console.print(f"- {line}", highlight=False, markup=False)


def _long_demo(out: Path, quiet: bool, overrides: list[str], eval_windows: int) -> None:
    from genome_lm.eval.probes.selection import describe

    result = run_long_demo(out, overrides=([], overrides), eval_windows=eval_windows, progress=not quiet,
                           on_dataset=lambda p: print_dataset_summary(p.manifest, reused=p.reused),
                           on_trained=_print_stage)
    print_report(result.report, console)
    print_verdict(result.report)
    for line in describe(result.selection):
        console.print(line, highlight=False)


def _dna_demo(fasta: Path | None, train: str | None, eval_region: str | None, out: Path, window: int, quiet: bool,
              config: str, overrides: list[str], drill: float = 0.0) -> None:
    from genome_lm.eval.report import study_summary

    missing = [flag for flag, value in (("--fasta", fasta), ("--train", train), ("--eval", eval_region)) if not value]
    if missing:
        raise GenomeLMError("the study on your own genome needs --fasta, --train and --eval; "
                            f"missing {', '.join(missing)}")
    if not Path(fasta).is_file():
        raise GenomeLMError(f"{fasta}: no such FASTA file")
    result = run_dna_demo(out, fasta, split_regions(train), eval_region, window, config=config, overrides=overrides,
                          progress=not quiet, on_dataset=lambda p: print_dataset_summary(p.manifest, reused=p.reused),
                          on_trained=_print_stage, drill=drill)
    print_report(result.report, console)
    console.print("[bold]the study in short[/bold]")
    for line in study_summary(result.report):
        console.print(f"- {line}", highlight=False, markup=False)


def _folds_demo(fasta: Path | None, folds: int | None, region: str | None, train: str | None, eval_region: str | None,
                out: Path, window: int, quiet: bool, config: str, overrides: list[str], drill: float = 0.0) -> None:

    missing = [flag for flag, value in (("--fasta", fasta), ("--folds", folds), ("--region", region)) if not value]
    if missing:
        raise GenomeLMError(f"the k-fold study needs --fasta, --folds and --region; missing {', '.join(missing)}")
    if train or eval_region:
        raise GenomeLMError("--folds chooses the training and held-out regions itself: leave out --train and --eval")
    if not Path(fasta).is_file():
        raise GenomeLMError(f"{fasta}: no such FASTA file")

    def announce(plan, k):
        console.rule(f"fold {plan.index} of {k}: held out {plan.held_out}, tuned on "
                     f"{', '.join(str(r) for r in plan.train)}")

    report = run_folds(out, fasta, region, folds, window, config=config, overrides=overrides, drill=drill,
                       progress=not quiet, on_fold=announce, on_trained=_print_stage,
                       on_dataset=lambda p: print_dataset_summary(p.manifest, reused=p.reused))
    print_folds(report, out / "folds.json")


def print_folds(report, path: Path, out=None, verb: str = "wrote") -> None:
    """Per fold and pooled: tuned, start and Markov bits/base, the change against the start at
    the shortest and longest context, and the far-context figures beyond 2N, with intervals;
    then the findings fold by fold."""

    from genome_lm.eval.ablation import fmt_delta_ci

    out = out or console
    table = Table(title=f"{report.k}-fold study of {report.region} (window {report.window:,}; [95% CI])",
                  title_justify="left")
    for header in ("fold", "held out", "tuned bits/base", "start", "Markov", "change vs start, first / last bucket",
                   "cut, beyond 2N", "gain vs start, beyond 2N", "unmasked", "repeats"):
        table.add_column(header, justify="right")

    def row(name, held_out, results, comparison, ablation):
        model = results["model"].all
        cells = [name, held_out, f"{model.bits:.4f} [{model.bits_ci[0]:.4f}, {model.bits_ci[1]:.4f}]",
                 f"{results['baseline'].all.bits:.4f}",
                 f"{results['markov'].all.bits:.4f}" if "markov" in results else "-"]
        measured = [b for b, r in zip(comparison.buckets, results["model"].buckets) if r.tokens and b.measured] \
            if comparison else []
        cells.append(" / ".join(f"{b.change * 100:+.2f}%" for b in (measured[0], measured[-1])) if measured else "-")
        cut = ablation.cuts[0] if ablation and ablation.cuts else None
        far = cut.beyond if cut else None
        cells.append(fmt_delta_ci(far.all) if far else "-")
        gain = cut.gain.beyond if cut and cut.gain and cut.gain.beyond else None
        cells += [fmt_delta_ci(getattr(gain, s)) if gain else "-" for s in ("all", "unmasked", "softmasked")]
        table.add_row(*cells)

    for f in report.folds:
        row(str(f.index), f.held_out, f.results, f.comparison, f.ablation)
    p = report.pooled
    row("pooled", report.region, p.results, p.comparison, p.ablation)
    out.print(table)
    out.print("[bold]the study in short[/bold]")
    for line in report.summary:
        out.print(f"- {line}", highlight=False, markup=False)
    out.print(f"{verb} {path}", highlight=False)


@app.command()
def folds(
    studies: Annotated[list[Path], typer.Argument(help="Folders of k-fold studies (genome-lm demo --folds --out DIR), "
                                                       "or their folds.json files.", show_default=False)],
    paired: Annotated[bool, typer.Option("--paired", help="Also set each study's tuned models against the first "
                                                         "study's on the same bases, from the folds' score caches: "
                                                         "the change in loss and the extra value of the far context, "
                                                         "pooled over the folds with paired intervals.")] = False,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples for --paired.", min=10)] = 1000,
) -> None:
    """Show a k-fold study's report again, or compare the recipes of several studies of the same folds.

    With one folder: its table (per fold and pooled, with 95% intervals) and its findings, read from folds.json.
    With several (e.g. the same --folds run with --drill 0.2, or --set 'train.lr_scale=...', each in its own --out):
    a row per study with its recipe, the far-context gain over the starting weights beyond 2N in each fold and pooled,
    the folds where that gain is above zero (its interval), and the tuned model against the Markov chain. The studies
    must hold out the same folds. --paired adds, for each study after the first, its tuned models against the first's
    on the same bases (read from each fold's score cache, run/eval/.scores): the change in loss, and how much more the
    context beyond the cut is worth to it, pooled with paired intervals stratified by fold."""
    reports = {str(path): read_folds(path) for path in studies}
    if len(reports) == 1:
        (path, report), = reports.items()
        print_folds(report, Path(path), verb="read")
        return
    print_recipes(compare_recipes(reports))
    if paired:
        folders = {str(path): Path(path) if Path(path).is_dir() else Path(path).parent for path in studies}
        for pair in pair_recipes({name: (folders[name], report) for name, report in reports.items()},
                                 resamples=resamples):
            print_pair(pair)


def print_recipes(rows, out=None) -> None:
    """The recipes' table (``folds.compare_recipes``)."""
    from genome_lm.eval.ablation import fmt_delta_ci

    out = out or console
    k = len(rows[0].gains)
    table = Table(title=f"Recipes over the same folds: the far-context gain over the start on bases with "
                        f"{rows[0].far:,}+ of context (nats/base, [95% CI])", title_justify="left")
    for header in ("study", "recipe", *(f"fold {i + 1}" for i in range(k)), "pooled", "gain > 0 in",
                   "tuned vs Markov, pooled bits/base", "below Markov in"):
        table.add_column(header, justify="left" if header in ("study", "recipe") else "right")
    for r in rows:
        markov = f"{r.tuned_bits:.4f} vs {r.markov_bits:.4f}" if r.markov_bits is not None else f"{r.tuned_bits:.4f}"
        table.add_row(r.name, r.recipe, *(fmt_delta_ci(g) if g else "-" for g in r.gains),
                      fmt_delta_ci(r.pooled_gain) if r.pooled_gain else "-", f"{r.gain_holds} of {k} folds", markov,
                      f"{r.markov.count('holds')} of {k} folds")
    out.print(table)


def print_pair(pair, out=None) -> None:
    """One study's tuned models against another's, in words (``folds.pair_recipes``)."""
    from genome_lm.eval.ablation import fmt_delta_ci

    out = out or console
    c = pair.comparison.all
    lo, hi = c.ci
    g = pair.gain
    out.print(f"{pair.name} against {pair.against}, on the same bases (95% CI, paired, stratified by fold): loss "
              f"{c.change * 100:+.2f}% [{lo * 100:+.2f}%, {hi * 100:+.2f}%]; the far context (bases with {pair.far:,}+ "
              f"of context) worth {fmt_delta_ci(g.all)} nats/base more to it (unmasked {fmt_delta_ci(g.unmasked)}, "
              f"repeats {fmt_delta_ci(g.softmasked)})", highlight=False)
    for key, bases in (("all", "all bases"), ("far", f"bases with {pair.far:,}+ of context")):
        if key in pair.kept:
            out.print(f"  {bases}:", highlight=False)
            for line in share_lines(pair.kept[key], pair.against, pair.name):  # short: 80 columns piped
                out.print(f"    {line}", highlight=False, soft_wrap=True)


def share_lines(share, first: str, other: str) -> list[str]:
    """A ``folds.Share`` in words: what share of ``first``'s loss drop from the start ``other`` keeps."""
    lines = [f"{first} lowers the loss from the start by {share.first_drop:+.4f} nats/base "
             f"[{share.first_drop_ci[0]:+.4f}, {share.first_drop_ci[1]:+.4f}],", f"{other} by {share.other_drop:+.4f}"]
    if share.share is None:
        return [*lines[:1], f"{lines[1]}; {first}'s drop is not above zero, so no share of it is taken"]
    lo, hi = share.ci
    return [*lines[:1], f"{lines[1]}: {other} keeps {share.share:.0%} of {first}'s drop [{lo:.0%}, {hi:.0%}]"]
