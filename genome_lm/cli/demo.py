"""``genome-lm demo``: the study end to end on the built-in demo genome (genome_lm.demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from genome_lm.demo import DEMO_CONFIG, DNA_CONFIG

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
words. The report goes to OUT/run/eval."""
    from genome_lm.demo import run_demo
    from genome_lm.eval.planted import demo_note

    if long:
        _long_demo(out or Path("data/long"), quiet, set_ or [], eval_windows)
        return
    if fasta is not None or train is not None or eval_region is not None:
        _dna_demo(fasta, train, eval_region, out or Path("data/dna"), size(window, "--window"), quiet,
                  config if config != DEMO_CONFIG else DNA_CONFIG, set_ or [])
        return
    out = out or Path("data/demo")
    result = run_demo(out, size(window, "--window"), config=config, overrides=set_, eval_windows=eval_windows,
                      progress=not quiet, on_dataset=lambda p: print_dataset_summary(p.manifest, reused=p.reused),
                      on_trained=print_training)
    report = result.report
    print_report(report, console)  # its headline sets the model against uniform, Markov and the starting weights
    console.print(f"(the model: checkpoint {report.models['model'].path})", highlight=False)
    if report.planted:
        console.print(demo_note(report.planted, result.config), highlight=False)


def _long_demo(out: Path, quiet: bool, overrides: list[str], eval_windows: int) -> None:
    from genome_lm.demo import run_long_demo
    from genome_lm.eval.planted import demo_note
    from genome_lm.eval.probes.selection import describe

    result = run_long_demo(out, overrides=([], overrides), eval_windows=eval_windows, progress=not quiet,
                           on_dataset=lambda p: print_dataset_summary(p.manifest, reused=p.reused),
                           on_trained=print_training)
    print_report(result.report, console)
    if result.report.planted:
        console.print(demo_note(result.report.planted), highlight=False)
    for line in describe(result.selection):
        console.print(line, highlight=False)


def _dna_demo(fasta: Path | None, train: str | None, eval_region: str | None, out: Path, window: int, quiet: bool,
              config: str, overrides: list[str]) -> None:
    from genome_lm.data.regions import split_regions
    from genome_lm.demo import run_dna_demo
    from genome_lm.errors import GenomeLMError
    from genome_lm.eval.report import study_summary

    missing = [flag for flag, value in (("--fasta", fasta), ("--train", train), ("--eval", eval_region)) if not value]
    if missing:
        raise GenomeLMError("the study on your own genome needs --fasta, --train and --eval; "
                            f"missing {', '.join(missing)}")
    if not Path(fasta).is_file():
        raise GenomeLMError(f"{fasta}: no such FASTA file")
    result = run_dna_demo(out, fasta, split_regions(train), eval_region, window, config=config, overrides=overrides,
                          progress=not quiet, on_dataset=lambda p: print_dataset_summary(p.manifest, reused=p.reused),
                          on_trained=print_training)
    print_report(result.report, console)
    console.print("[bold]the study in short[/bold]")
    for line in study_summary(result.report):
        console.print(f"- {line}", highlight=False, markup=False)
