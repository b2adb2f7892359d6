"""``genome-lm score``: per-base tracks of a model over genome regions (``genome_lm.eval.tracks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from genome_lm.data.demo_genome import planted_json_path
from genome_lm.data.regions import Region, parse_region, split_regions
from genome_lm.engine import quiet_megatron_import
from genome_lm.eval.track_compare import compare_tracks
from genome_lm.eval.track_plot import first_scored, plot_tracks, read_region

from .base import app, console, size
from .eval import parallel_layout


@app.command("score")
def score_command(
    model: Annotated[str, typer.Option(help="The model: a training run folder (its latest checkpoint), a checkpoint "
                                            "folder, a Hugging Face glm5_next folder, or builtin:tiny-long.")],
    fasta: Annotated[Path, typer.Option(help="The genome FASTA (plain, gzip or BGZF).")],
    out: Annotated[Path, typer.Option(help="A new folder for tracks.parquet, one bigWig per track and score.json.")],
    regions: Annotated[str, typer.Option("--regions", help="Chromosomes or regions, comma-separated, 1-based "
                                                           "inclusive: chr22 or chr2:1-1,000,000.")] = "",
    bed: Annotated[Optional[Path], typer.Option(help="A BED file of intervals to score (0-based, end exclusive; "
                                                     "with --regions or alone).")] = None,
    window: Annotated[str, typer.Option(help="Window length each base is scored in (up to 1M).")] = "32k",
    context: Annotated[str, typer.Option(help="Every base is scored with at least this many bases before it (fewer "
                                              "only near a record's start): windows overlap by it.")] = "8k",
    chunk: Annotated[str, typer.Option(help="Chunked prefill: tokens per forward chunk (memory bounded whatever the "
                                            "window); '0' runs each window in one forward.")] = "32k",
    probs: Annotated[bool, typer.Option("--probs", help="Also the probabilities of A, C, G and T as tracks.")] = False,
    embeddings: Annotated[Optional[str], typer.Option(help="Also write hidden states to OUT/embeddings.zarr: "
                                                           "layers, comma-separated, by index from 0 (negative "
                                                           "from the end) or 'final' (the final norm's output, "
                                                           "what the output layer reads).",
                                                      show_default=False)] = None,
    pool: Annotated[Optional[str], typer.Option(help="With --embeddings: 'mean:N' writes the mean of every N "
                                                     "bases from each region's start instead of every base (N "
                                                     "must divide the window less the context).",
                                                show_default=False)] = None,
    embedding_dtype: Annotated[str, typer.Option(help="With --embeddings: float16 or float32.")] = "float16",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Over many ranks (torchrun --nproc-per-node N "
                                                                    "-m genome_lm score ...): the model's split, "
                                                                    "parallel.tp / cp / ep / etp / pp / "
                                                                    "sequence_parallel = value, as for eval; the "
                                                                    "ranks left over share the segments.",
                                                     show_default=False)] = None,
    plot: Annotated[bool, typer.Option("--plot", help="Also OUT/tracks.png: the loss, entropy and context over the "
                                                      "first region (200 kbp from its first base with a score: past "
                                                      "leading N), soft-masked repeats "
                                                      "shaded, and a demo genome's planted copies marked (read from "
                                                      "the FASTA's .planted.json when there is one).")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Per-base tracks of a model over genome regions, each base scored once, in genomic order:
    the log-likelihood of the reference base (nats), the entropy of the predicted distribution, the
    context it was scored with, and with --probs the A/C/G/T probabilities; as bigWig (one file per
    track, for genome browsers and pyBigWig) and one Parquet table; with --embeddings also the
    chosen layers' hidden states, per base or pooled, as Zarr. Over many ranks under torchrun
    (tensor, context, expert, pipeline and data parallel; rank 0 assembles the outputs); OUT must then be on
    a filesystem every rank sees."""
    from genome_lm.eval.tracks import ScoreRequest, score_fasta

    chunk_tokens = 0 if chunk.strip() in ("0", "none") else size(chunk, "--chunk")
    req = ScoreRequest(model=model, fasta=fasta, regions=split_regions(regions), out=out, bed=bed,
                       window=size(window, "--window"), context=size(context, "--context"),
                       chunk=chunk_tokens or None, probs=probs, embeddings=embeddings, pool=pool,
                       embedding_dtype=embedding_dtype, layout=parallel_layout(set_))
    with quiet_megatron_import():
        summary = score_fasta(req, progress=not quiet)
    if summary is None:  # a rank other than 0: rank 0 reports
        return
    bigwigs = [f for f in summary["files"] if f.endswith(".bw")]
    lines = [f"scored {summary['bases_scored']:,} bases of {', '.join(summary['regions'])}", f"into {out}:",
             "  tracks.parquet (every base), score.json (the settings)", f"  a bigWig per track: {', '.join(bigwigs)}"]
    if summary["embeddings"]:
        e = summary["embeddings"]
        lines.append(f"  embeddings.zarr: {', '.join(e['layers'])}, {e['dtype']}, "
                     + ("every base" if e["pool"] == 1 else f"the mean of every {e['pool']:,} bases"))
    if plot:
        region = parse_region(summary["regions"][0])  # bounded: its end is where the first region ends
        lines += _plot(out, Region(region.name, region.start, None), planted_for(fasta), out / "tracks.png")
    for line in lines:  # short lines: the output reads at 80 columns when piped
        console.print(line, highlight=False, soft_wrap=True)


PLOT_BASES = 200_000  # score --plot draws this much of the first region, from its first base with a score


def planted_for(fasta: Path) -> Path | None:
    """A demo genome's planted-copies sidecar beside ``fasta``, if there is one."""
    path = planted_json_path(fasta)
    return path if path.is_file() else None


def _plot(folder: Path, region: Region | None, planted: Path | None, png: Path, smooth: int = 101) -> list[str]:
    """Draw ``region`` of ``folder``'s tracks into ``png``; the lines that say what was drawn."""
    from genome_lm.eval.planted import load_planted
    if region is not None and region.end is None:  # score --plot: PLOT_BASES from the first base with a score
        start = first_scored(folder, region.name, region.start)
        region = Region(region.name, region.start if start is None else start, (start or region.start) + PLOT_BASES)
    view = read_region(folder, region)
    summary = plot_tracks(view, png, planted=load_planted(planted) if planted else None, smooth=smooth)
    lines = [f"  {png.name}: {view.chrom}:{view.positions[0] + 1:,}-{view.positions[-1] + 1:,}"]
    if summary:
        for name, (loss, n) in summary.items():
            lines.append(f"    {name}: {loss:.4f} nats/base over {n:,} bases" if n else f"    {name}: none")
    return lines


@app.command("plot-tracks")
def plot_tracks_command(
    folder: Annotated[Path, typer.Argument(help="A folder genome-lm score wrote (its tracks.parquet).",
                                           show_default=False)],
    out: Annotated[Path, typer.Option(help="The PNG to write.")],
    region: Annotated[Optional[str], typer.Option(help="chr:start-end (1-based, inclusive) to draw; default the "
                                                       "first region scored.", show_default=False)] = None,
    planted: Annotated[Optional[Path], typer.Option(help="A demo genome's .planted.json: mark its later copies, "
                                                         "green where the first copy was in context, red where "
                                                         "not.", show_default=False)] = None,
    smooth: Annotated[int, typer.Option(help="Running mean over this many bases for the loss and entropy.",
                                        min=1)] = 101,
) -> None:
    """The picture of score's tracks over a region: the loss (minus the log-likelihood of the
    reference base), the entropy and the context of every base, soft-masked repeats shaded grey,
    and with --planted the demo genome's later copies, with the mean loss of those whose first copy
    was in context against those where it was not."""
    lines = _plot(folder, parse_region(region) if region else None, planted, out, smooth)
    console.print(f"wrote {out}", highlight=False, soft_wrap=True)
    for line in lines[1:]:
        console.print(line.strip(), highlight=False, soft_wrap=True)


@app.command("compare-tracks")
def compare_tracks_command(
    first: Annotated[Path, typer.Argument(help="A folder genome-lm score wrote: the model whose gain is measured.",
                                          show_default=False)],
    second: Annotated[Path, typer.Argument(help="Another score folder of the same bases: the model it is measured "
                                                "against (e.g. the tuned model's starting weights).",
                                           show_default=False)],
    block: Annotated[str, typer.Option(help="Bootstrap blocks of this many bases (neighbouring bases are not "
                                            "independent).")] = "10k",
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples.", min=10)] = 1000,
) -> None:
    """Two score runs of the same bases, base by base: the mean gain of the first model's
    log-likelihood of the reference over the second's (nats/base, above zero: the first predicts
    better), overall, on unmasked and soft-masked (repeat) bases and by the context the base was
    scored with, with 95% block-bootstrap intervals and the share of bases where the first is better."""
    rows = compare_tracks(first, second, block=size(block, "--block"), resamples=resamples)
    table = Table(title=f"{first} against {second}: log-likelihood gain, nats/base [95% CI]", title_justify="left")
    for header in ("bases", "count", "gain", "95% CI", "first better on"):
        table.add_column(header, justify="left" if header == "bases" else "right")
    for r in rows:
        table.add_row(r.name, f"{r.bases:,}", f"{r.gain:+.4f}", f"[{r.ci[0]:+.4f}, {r.ci[1]:+.4f}]",
                      f"{r.better:.1%}")
    console.print(table)
