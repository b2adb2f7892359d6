"""The `genome-lm` command line. Each command parses its options and calls one function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from genome_lm import __version__
from genome_lm.errors import GenomeLMError

app = typer.Typer(
    help="Fine-tune a long-context genome language model: prepare data, train, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """``"524288"``, ``"512k"`` or ``"1M"`` -> bases (k = 1,024; M = 1,048,576)."""
    text = text.strip().lower().removesuffix("b")
    scale = SIZE_SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(number) * scale
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a size like 524288, 512k or 1M") from None
    if value < 1:
        raise typer.BadParameter("must be at least 1")
    return value


def _chroms(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _fail(exc: GenomeLMError) -> None:
    Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _version(value: bool) -> None:
    if value:
        console.print(f"genome-lm {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """genome-lm: fine-tune a long-context genome language model."""


@app.command()
def prepare(
    fasta: Annotated[Path, typer.Option(help="Genome FASTA: plain, gzip or BGZF; an index beside it is used.")],
    out: Annotated[Path, typer.Option(help="Output dataset folder (created; replaced atomically).")] = Path(
        "data/prepared"
    ),
    train_chroms: Annotated[
        str, typer.Option(help="Comma-separated chromosomes for training; chr1, 1 and NC_000001.11 all match.")
    ] = "chr1,chr2",
    eval_chroms: Annotated[str, typer.Option(help="Comma-separated chromosomes for evaluation ('' for none).")] = "chr22",
    window: Annotated[str, typer.Option(help="Window length in bases: 524288, 512k, 1M (k=1024, M=1048576).")] = "512k",
    stride: Annotated[
        Optional[str], typer.Option(help="Distance between window starts; default: the window (no overlap).")
    ] = None,
    tail: Annotated[
        str, typer.Option(help="The bases after the last full window: 'keep' as one shorter window, or 'drop'.")
    ] = "keep",
    min_tail: Annotated[str, typer.Option(help="A kept tail needs at least this many bases, else it is dropped.")] = "4k",
    max_n: Annotated[
        float, typer.Option(help="Skip (and record) windows whose fraction of N bases is above this.")
    ] = 0.5,
    workers: Annotated[
        Optional[int], typer.Option(help="Worker processes on this machine; default: one per core but one (1: no worker processes).", min=1)
    ] = None,
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            help="Run the work as Ray tasks on this cluster ('auto', 'host:port'); every node must see the FASTA and --out at the same paths."
        ),
    ] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a finished dataset for the same request exists.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Stream a genome FASTA into tokenized windows (Megatron .bin/.idx + manifest).

    Defaults reproduce the study: chr1 and chr2 for training, chr22 for evaluation, 512k-base windows. One token per base (A C G T N); soft-masked bases keep a per-token flag.
    """
    from genome_lm.data.prepare import PrepareRequest
    from genome_lm.data.prepare import prepare as run_prepare
    from genome_lm.data.windows import WindowSpec

    try:
        size = parse_size(window)
        spec = WindowSpec(size, parse_size(stride) if stride else size, tail, parse_size(min_tail), max_n)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    request = PrepareRequest(fasta, out, _chroms(train_chroms), _chroms(eval_chroms), spec)
    try:
        result = run_prepare(request, workers=workers, ray_address=ray_address, force=force, quiet=quiet)
    except GenomeLMError as exc:
        _fail(exc)
    print_dataset_summary(result.manifest, reused=result.reused)


def print_dataset_summary(manifest, reused: bool = False) -> None:
    table = Table(title=f"{manifest.folder}" + (" (already up to date)" if reused else ""))
    for column in ("split", "chromosomes", "windows", "skipped", "tokens", "soft-masked", "N"):
        table.add_column(column, justify="left" if column in ("split", "chromosomes") else "right")
    for name in manifest.data["splits"]:
        split = manifest.split(name)
        total = max(split.n_tokens, 1)
        soft = sum(w.softmask_frac * w.length for w in split.windows) / total
        n_frac = sum(w.n_frac * w.length for w in split.windows) / total
        chroms = ", ".join(c["record"] for c in split.data["chromosomes"])
        table.add_row(
            name,
            chroms,
            f"{len(split.windows):,}",
            f"{len(split.data['skipped']):,}",
            f"{split.n_tokens:,}",
            f"{soft:.1%}",
            f"{n_frac:.2%}",
        )
    console.print(table)


@app.command("demo-genome")
def demo_genome(
    out: Annotated[Path, typer.Option(help="FASTA to write; the planted copies go to <out>.planted.json.")] = Path(
        "data/demo/genome.fa"
    ),
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same genome.")] = 0,
    scale: Annotated[float, typer.Option(help="Length multiplier (1.0: chr1 4 Mbp, chr2 3 Mbp, chr22 2 Mbp).")] = 1.0,
) -> None:
    """Write the built-in synthetic demo genome (chr1, chr2, chr22) with planted long-range copies."""
    from genome_lm.data.demo_genome import planted_json_path, write_demo_genome

    try:
        path = write_demo_genome(out, seed=seed, scale=scale)
    except GenomeLMError as exc:
        _fail(exc)
    console.print(f"wrote {path} and {planted_json_path(path)}")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Folder for the demo's genome and dataset.")] = Path("data/demo"),
    window: Annotated[str, typer.Option(help="Window length for the demo dataset.")] = "32k",
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Run the study end to end on the built-in demo genome, on this CPU.

    Stages available so far: demo genome -> prepare. The finetune and eval stages join as they land.
    """
    from genome_lm.data.demo_genome import write_demo_genome
    from genome_lm.data.prepare import PrepareRequest
    from genome_lm.data.prepare import prepare as run_prepare
    from genome_lm.data.windows import WindowSpec

    fasta = out / "genome.fa"
    size = parse_size(window)
    request = PrepareRequest(fasta, out / "dataset", windows=WindowSpec(size, size))
    try:
        if not fasta.exists():
            write_demo_genome(fasta)
        result = run_prepare(request, quiet=quiet)
    except GenomeLMError as exc:
        _fail(exc)
    print_dataset_summary(result.manifest, reused=result.reused)
    console.print("finetune and eval stages are not built yet; the dataset above is ready for them.")


bench_app = typer.Typer(help="Benchmarks that compare against a baseline in the same run and print the ratio.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _print_rows(title: str, rows: list[dict], columns: dict[str, str]) -> None:
    """``columns`` maps a row key to its heading; the other keys are settings, shown once."""
    settings = {k: v for k, v in rows[0].items() if k not in columns and v not in (None, False) and all(r.get(k) == v for r in rows)}
    table = Table(title=title, caption=", ".join(f"{k}={v}" for k, v in settings.items()))
    for heading in columns.values():
        table.add_column(heading, justify="left" if heading in ("path", "mode", "note") else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(key, "")) for key in columns))
    console.print(table)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if value != value else (f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}")
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _with_ratio(rows: list[dict], key: str, group: tuple[str, ...], baseline: dict, out: str) -> list[dict]:
    """Add ``out`` = row[key] / baseline row's [key], the baseline being the row of the same
    ``group`` values that matches ``baseline``."""
    base = {tuple(r[g] for g in group): r[key] for r in rows if all(r.get(k) == v for k, v in baseline.items())}
    for row in rows:
        ref = base.get(tuple(row[g] for g in group))
        row[out] = row[key] / ref if ref and row.get(key) == row.get(key) and row.get(key) is not None else None
    return rows


@bench_app.command("kernels")
def bench_kernels(
    seq_lens: Annotated[str, typer.Option(help="Comma-separated sequence lengths (k=1024).")] = "8k,32k,128k",
    op: Annotated[str, typer.Option(help="Which ops: kda, dsa or all.")] = "all",
    backward: Annotated[bool, typer.Option(help="Time KDA forward+backward too (slow for the reference).")] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write every row, all fields, to this file.")] = None,
) -> None:
    """KDA chunked vs its token-by-token reference (and transformers' torch fallback); DSA sparse vs dense masked attention: time and peak memory on this machine, with the ratio to the baseline."""
    import json

    lengths = tuple(parse_size(x) for x in seq_lens.split(","))
    if op not in ("kda", "dsa", "all"):
        raise typer.BadParameter("choose kda, dsa or all", param_hint="--op")
    results = {}
    if op in ("kda", "all"):
        from genome_lm_kernels.kda.bench import bench as bench_kda

        rows = _with_ratio(bench_kda(lengths=lengths, backward=backward), "seconds", ("mode", "T"), {"impl": "torch"}, "x torch time")
        results["kda"] = rows
        _print_rows("KDA (time relative to the chunked torch path)", rows,
                    {"impl": "path", "mode": "mode", "T": "T", "seconds": "seconds", "x torch time": "x torch time",
                     "peak_mib": "peak MiB", "note": "note"})
    if op in ("dsa", "all"):
        from genome_lm_kernels.dsa.bench import bench as bench_dsa

        rows = bench_dsa(lengths=lengths)
        for row in rows:
            row["peak_mib"] = row["peak_bytes"] / 2**20 if row.get("peak_bytes") is not None else None
            row["kib_per_token"] = row["bytes_per_token"] / 1024 if row.get("bytes_per_token") is not None else None
            row["note"] = row.get("skipped") or ("extrapolated" if row.get("extrapolated") else "measured")
        _with_ratio(rows, "time_s", ("T",), {"path": "sparse"}, "x sparse time")
        _with_ratio(rows, "peak_mib", ("T",), {"path": "sparse"}, "x sparse memory")
        results["dsa"] = rows
        _print_rows("DSA forward+backward (relative to the sparse path)", rows,
                    {"path": "path", "T": "T", "time_s": "seconds", "x sparse time": "x sparse time",
                     "peak_mib": "peak MiB", "kib_per_token": "KiB/token", "x sparse memory": "x sparse mem",
                     "note": "note"})
    if json_out:
        json_out.write_text(json.dumps(results, indent=1, default=str) + "\n")

@app.command()
def parity(
    hf: Annotated[Path, typer.Option("--hf", help="A glm5_next checkpoint folder written by transformers' save_pretrained.")],
    lengths: Annotated[str, typer.Option(help="Comma-separated sequence lengths (k=1024).")] = "1,63,64,65,257,1000,4096",
    tol: Annotated[float, typer.Option(help="Largest allowed |logit difference| (fp32).")] = 1e-4,
    seed: Annotated[int, typer.Option(help="Seed of the random DNA tokens.")] = 0,
    backend: Annotated[str, typer.Option(help="Kernel backend of genome-lm's model: auto, torch, triton, reference.")] = "auto",
) -> None:
    """Check genome-lm's model against transformers' glm5_next on the same checkpoint.

    Loads the checkpoint in transformers and through genome-lm's loader, runs both on the same
    random DNA tokens at each length, prints the largest |logit difference| per length, and exits
    with status 1 when any length exceeds --tol. Works for any glm5_next text config that
    genome-lm supports (NoPE MLA, one router group)."""
    from genome_lm.model.parity import run_parity

    sizes = [parse_size(x) for x in lengths.split(",") if x.strip()]
    if not hf.is_dir():
        _fail(GenomeLMError(f"{hf}: not a folder"))
    table = Table(title=f"genome-lm vs transformers on {hf}", title_justify="left")
    for column in ("T", "max |d logit|", "mean |d logit|", "max |d logprob|", f"<= {tol:g}"):
        table.add_column(column, justify="right")

    def show(row):
        console.print(f"T={row.length:,}: max |d logit| {row.max_abs_logit:.3g}", highlight=False)

    try:
        with quiet_megatron_import_ctx():
            rows = run_parity(hf, sizes, tol=tol, seed=seed, kernel_backend=backend, progress=show)
    except GenomeLMError as exc:
        _fail(exc)
    for row in rows:
        table.add_row(f"{row.length:,}", f"{row.max_abs_logit:.3g}", f"{row.mean_abs_logit:.3g}",
                      f"{row.max_abs_logprob:.3g}", "yes" if row.passed else "[bold red]NO[/]")
    console.print(table)
    failed = [r.length for r in rows if not r.passed]
    if failed:
        Console(stderr=True).print(f"[bold red]parity failed[/] at T = {', '.join(map(str, failed))} (tolerance {tol:g})")
        raise typer.Exit(1)
    console.print(f"parity holds at every length (tolerance {tol:g})")


def quiet_megatron_import_ctx():
    from genome_lm.engine import quiet_megatron_import

    return quiet_megatron_import()


def run() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
