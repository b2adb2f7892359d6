"""Data commands: ``prepare`` (FASTA -> tokenized windows) and ``demo-genome``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from genome_lm.data.demo_genome import CopyPlan, planted_json_path, write_demo_genome
from genome_lm.data.regions import split_regions
from genome_lm.data.windows import MAX_N_FRACTION, WindowSpec
from genome_lm.units import parse_size_range

from .base import app, console, size


@app.command()
def prepare(
    fasta: Annotated[Path, typer.Option(help="Genome FASTA: plain, gzip or BGZF; an index beside it is used.")],
    out: Annotated[Path, typer.Option(help="Output dataset folder (created; replaced atomically).")] = Path(
        "data/prepared"
    ),
    train_chroms: Annotated[
        str, typer.Option(help="Comma-separated chromosomes or regions for training; chr1, 1 and NC_000001.11 all "
                               "match; a region as samtools writes it, chr2:1-1,800,000 (1-based, inclusive, commas "
                               "allowed), holds out the rest of the chromosome.")
    ] = "chr1,chr2",
    eval_chroms: Annotated[str, typer.Option(help="Comma-separated chromosomes or regions for evaluation ('' for "
                                                  "none), e.g. chr2:1,800,001-2,333,275; train and eval regions must "
                                                  "not overlap.")] = "chr22",
    window: Annotated[str, typer.Option(help="Window length in bases: 524288, 512k, 1M (k=1024, M=1048576).")] = "512k",
    stride: Annotated[
        Optional[str], typer.Option(help="Distance between window starts; default: the window (no overlap).")
    ] = None,
    eval_stride: Annotated[
        Optional[str], typer.Option(help="Distance between window starts in the evaluation split only; below the "
                                         "window, each held-out base is scored at several context lengths (genome-lm "
                                         "eval bootstraps over blocks of sequence then). Default: --stride.")
    ] = None,
    tail: Annotated[
        str, typer.Option(help="The bases after the last full window: 'keep' as one shorter window, or 'drop'.")
    ] = "keep",
    min_tail: Annotated[str,
                        typer.Option(help="A kept tail needs at least this many bases, else it is dropped.")] = "4k",
    max_n: Annotated[
        float, typer.Option(help="Skip (and record) windows whose fraction of N bases is above this.")
    ] = MAX_N_FRACTION,
    workers: Annotated[
        Optional[int], typer.Option(help="Worker processes on this machine; default: one per core but one (1: no "
                                         "worker processes).", min=1)
    ] = None,
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            help="Run the work as Ray tasks on this cluster ('auto', 'host:port'); every node must see the FASTA and "
                 "--out at the same paths."
        ),
    ] = None,
    force: Annotated[bool,
                     typer.Option(help="Rebuild even if a finished dataset for the same request exists.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Stream a genome FASTA into tokenized windows (Megatron .bin/.idx + manifest).

    Defaults reproduce the study: chr1 and chr2 for training, chr22 for evaluation, 512k-base windows. One token per
    base (A C G T N); soft-masked bases keep a per-token flag.
    """
    from genome_lm.data.prepare import PrepareRequest
    from genome_lm.data.prepare import prepare as run_prepare

    length = size(window, "--window")
    try:
        spec = WindowSpec(length, size(stride, "--stride") if stride else length, tail, size(min_tail, "--min-tail"),
                          max_n)
        request = PrepareRequest(fasta, out, split_regions(train_chroms), split_regions(eval_chroms), spec,
                                 size(eval_stride, "--eval-stride") if eval_stride else None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    result = run_prepare(request, workers=workers, ray_address=ray_address, force=force, quiet=quiet)
    print_dataset_summary(result.manifest, reused=result.reused)


def print_dataset_summary(manifest, reused: bool = False) -> None:
    """One row per split: records, windows, skipped windows, tokens, soft-masked and N fractions."""
    table = Table(title=f"{manifest.folder}" + (" (already up to date)" if reused else ""))
    for column in ("split", "chromosomes", "windows", "skipped", "tokens", "soft-masked", "N"):
        table.add_column(column, justify="left" if column in ("split", "chromosomes") else "right")
    for name in manifest.data["splits"]:
        split = manifest.split(name)
        table.add_row(name, ", ".join(split.records), f"{len(split.windows):,}", f"{len(split.data['skipped']):,}",
                      f"{split.n_tokens:,}", f"{split.softmask_fraction:.1%}", f"{split.n_fraction:.2%}")
    console.print(table)


@app.command("demo-genome")
def demo_genome(
    out: Annotated[Path, typer.Option(help="FASTA to write; the planted copies go to OUT.planted.json.")] = Path(
        "data/demo/genome.fa"
    ),
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same genome.")] = 0,
    scale: Annotated[float, typer.Option(help="Length multiplier (1.0: chr1 4 Mbp, chr2 3 Mbp, chr22 2 Mbp).")] = 1.0,
    copies_per_mbp: Annotated[
        Optional[float], typer.Option(help="Planted copies per Mbp (default 50).")
    ] = None,
    copy_length: Annotated[
        Optional[str], typer.Option(help="Copy lengths in bases, log-uniform in LOW-HIGH (default 300-3000).")
    ] = None,
    copy_distance: Annotated[
        Optional[str],
        typer.Option(help="Distance from a source to its copy, log-uniform in LOW-HIGH (default 1000-500000). "
                     "A long-context recipe keeps it inside its training crop, e.g. 256-16k."),
    ] = None,
    inversions: Annotated[
        Optional[float], typer.Option(help="Fraction of copies that are reverse complements (default 0.5).")
    ] = None,
    drill: Annotated[
        Optional[str],
        typer.Option(help="Add a record 'drill' of this many bases (e.g. 4M): random sequence where most bases repeat "
                     "something up to --copy-distance's high end before them, the dense copy signal a small model "
                     "needs to start using long context. Train on it with --train-chroms chr1,chr2,drill."),
    ] = None,
) -> None:
    """Write the built-in synthetic demo genome (chr1, chr2, chr22) with planted long-range copies."""
    plan, changes = CopyPlan(), {}
    if copies_per_mbp is not None:
        changes["per_mbp"] = copies_per_mbp
    if inversions is not None:
        changes["inversions"] = inversions
    for name, text, option in (("length_bp", copy_length, "--copy-length"),
                               ("distance_bp", copy_distance, "--copy-distance")):
        if text is not None:
            try:
                changes[name] = parse_size_range(text)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=option) from None
    path = write_demo_genome(out, seed=seed, scale=scale, copies=replace(plan, **changes),
                             drill_bp=size(drill, "--drill") or 0)
    console.print(f"wrote {path} and {planted_json_path(path)}")
