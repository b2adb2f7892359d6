"""The `genome-lm` command line. Each command parses its options and calls one function."""

from __future__ import annotations

import os
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
    # docstrings are reflowed into paragraphs (a blank line separates them), so --help never
    # breaks a sentence where the source line did
    rich_markup_mode="markdown",
)


def _flags_without_type() -> None:
    """typer (0.29) prints a flag's type as "<bool>" beside it in --help (``--version <bool>``);
    a flag takes no value, so show none."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich


_flags_without_type()
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
    config: Annotated[str, typer.Option(help="Training config (name in configs/ or a path).")] = "demo-cpu",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a training field (repeatable).")] = None,
    eval_windows: Annotated[int, typer.Option(help="Evaluation windows of chr22 to score (each model), evenly spaced.")] = 8,
) -> None:
    """Run the study end to end on the built-in demo genome, on this CPU.

    demo genome -> prepare (chr1, chr2 train; chr22 eval) -> fine-tune the tiny model (config demo-cpu, tracked in MLflow) -> `genome-lm eval` of the tuned against the starting model on the same chr22 windows: loss by preceding-context length with 95% intervals, and the loss on planted later copies whose first copy lies inside the window against those whose first copy lies outside it. The report goes to <out>/run/eval-chr22 and to MLflow."""
    from genome_lm.config import load_config
    from genome_lm.data.demo_genome import write_demo_genome
    from genome_lm.data.prepare import PrepareRequest
    from genome_lm.data.prepare import prepare as run_prepare
    from genome_lm.data.windows import WindowSpec
    from genome_lm.eval.evaluate import EvalRequest, evaluate
    from genome_lm.train.trainer import train

    fasta = out / "genome.fa"
    size = parse_size(window)
    request = PrepareRequest(fasta, out / "dataset", windows=WindowSpec(size, size))
    try:
        if not fasta.exists():
            write_demo_genome(fasta)
        result = run_prepare(request, quiet=quiet)
        print_dataset_summary(result.manifest, reused=result.reused)
        cfg = load_config(config, [f"data.dataset={out / 'dataset'}", f"train.out_dir={out / 'run'}", *(set_ or [])])
        with quiet_megatron_import_ctx():
            from genome_lm.train.trainer import existing_checkpoints

            # a demo run again continues its own run (a finished one runs no step) and reuses the scores
            trained = train(cfg, progress=not quiet, resume=bool(existing_checkpoints(out / "run")))
            _print_training(trained)
            report = evaluate(EvalRequest(model=str(out / "run"), baseline="init", chrom="chr22",
                                          out=out / "run" / "eval-chr22", max_windows=eval_windows),
                              progress=not quiet)
    except GenomeLMError as exc:
        _fail(exc)
    _print_comparison(report, cfg)


def _print_comparison(report: dict, cfg=None) -> None:
    """The demo's summary: `genome-lm eval`'s table, the overall change, and what the planted
    copies show (with what it would take when the tiny model shows nothing)."""
    from genome_lm.eval.commands import print_report
    from genome_lm.eval.planted import demo_note

    print_report(report, console)  # its headline sets the model against uniform, Markov and the starting weights
    console.print(f"(the model: checkpoint {report['models']['model']['path']})", highlight=False)
    if report.get("planted"):
        console.print(demo_note(report["planted"], cfg), highlight=False)


# evaluation commands (issue 6): genome_lm/eval/commands.py
from genome_lm.eval import commands as _eval_commands  # noqa: E402

_eval_commands.register(app)


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
    compile_for: Annotated[Optional[str], typer.Option(
        help="Instead of timing: compile every Triton kernel for these GPU targets (sm_90, sm_100; no GPU "
             "needed) at the shipped configs' per-rank shapes and report shared memory, registers, spills, "
             "tensor-core instructions and compile time. Exits 1 if a kernel would not launch or spills.")] = None,
) -> None:
    """KDA chunked vs its token-by-token reference (and transformers' torch fallback); DSA sparse vs dense masked attention: time and peak memory on this machine, with the ratio to the baseline."""
    import json

    if op not in ("kda", "dsa", "all"):
        raise typer.BadParameter("choose kda, dsa or all", param_hint="--op")
    if compile_for:
        _compile_check(compile_for, op, json_out)
        return
    lengths = tuple(parse_size(x) for x in seq_lens.split(","))
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


def _compile_check(targets: str, op: str, json_out: Path | None) -> None:
    import json

    from genome_lm_kernels.compile_check import TARGETS, run_in_subprocess

    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise typer.BadParameter(f"unknown target {', '.join(unknown) or targets!r}; choose from {', '.join(TARGETS)}",
                                 param_hint="--compile-for")
    with console.status(f"compiling every kernel for {', '.join(names)} (about a minute per target)"):
        rows = run_in_subprocess(names, "kda,dsa" if op == "all" else op)
    for row in rows:
        row["problem"] = "; ".join(row["problems"]) or ("spills (fp32 parity mode)" if row["local_bytes"] else "")
    _print_rows("Triton kernels compiled for the target (nothing launched)", rows,
                {"target": "target", "case": "op and shape", "kernel": "kernel", "shared_bytes": "shared B",
                 "registers": "regs", "local_bytes": "spill B", "mma": "tensor-core ops", "compile_s": "compile s",
                 "problem": "note"})
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if r["problems"]]
    if bad:
        Console(stderr=True).print(f"{len(bad)} kernel(s) would not launch or would spill on the target "
                                   "(see the note column)", highlight=False)
        raise typer.Exit(1)


@bench_app.command("model")
def bench_model(
    preset: Annotated[str, typer.Option(help="Model preset (tiny, glm-5.3-flash-4layer, glm-5.3-flash).")] = "tiny",
    seq_lens: Annotated[str, typer.Option(help="Comma-separated sequence lengths (k=1024).")] = "2k,8k",
    compare_transformers: Annotated[bool, typer.Option(
        help="Also time transformers' glm5_next with the same weights (slow: only at these lengths).")] = False,
    repeats: Annotated[int, typer.Option(help="Timed steps after the warm-up (fewer once 30 s of steps have run); the median is shown.", min=1)] = 3,
    threads: Annotated[Optional[int], typer.Option(help="torch threads in every run; default: the cores this process may use.", min=1)] = None,
    timeout: Annotated[float, typer.Option(help="Seconds allowed per run (model build + warm-up + timed steps); transformers reports 'timeout' past it.")] = 1200.0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write every row, all fields, to this file.")] = None,
) -> None:
    """Forward+backward of the whole model (batch 1, random DNA, next-token loss): seconds, tokens/s and peak memory per length, and the speed-up over transformers' glm5_next on the same weights."""
    import json

    from genome_lm.model.bench import bench, default_threads, growth
    from genome_lm.model.presets import PRESETS

    if preset not in PRESETS:
        raise typer.BadParameter(f"choose from {', '.join(PRESETS)}", param_hint="--preset")
    lengths = tuple(parse_size(x) for x in seq_lens.split(",") if x.strip())
    threads = threads or default_threads()
    console.print(f"torch threads: {threads}", highlight=False)

    def show(row):
        done = f"{row['seconds']:.3g} s" if row.get("seconds") else row.get("note", "")
        console.print(f"{row['impl']} T={row['T']:,}: {done}", highlight=False)

    try:
        rows = bench(preset, lengths, compare_transformers=compare_transformers, repeats=repeats, threads=threads,
                     timeout_s=timeout, progress=show)
    except RuntimeError as exc:
        _fail(GenomeLMError(str(exc)))
    shown = [dict(r, note=None if r.get("note") == "measured" else r.get("note"), loss=None, backend=None,
                  warmup_s=None, repeats=None) for r in rows]
    _print_rows(f"{preset}: forward+backward, batch 1, median of up to {repeats} steps", shown,
                {"T": "T", "impl": "path", "seconds": "seconds", "tokens_per_s": "tokens/s", "peak_mib": "peak MiB",
                 "speedup": "speed-up", "note": "note"})
    console.print("speed-up = transformers seconds / genome-lm seconds; "
                  + "; ".join(sorted({f"{r['impl']}: {r['backend']}" for r in rows if r.get("backend")})), highlight=False)
    losses = {}
    for r in rows:
        if r.get("loss") is not None:
            losses.setdefault(r["T"], {})[r["impl"]] = r["loss"]
    for T, pair in losses.items():
        if len(pair) == 2:  # the same weights and tokens must give the same loss
            console.print(f"loss at T={T:,}: " + ", ".join(f"{k} {v:.6f}" for k, v in pair.items()), highlight=False)
    steps = growth(rows)
    for g in steps:
        memory = f", x{g['memory']:.1f} memory" if g["memory"] else ""
        console.print(f"{g['impl']} {g['T_from']:,} -> {g['T_to']:,}: x{g['tokens']:.1f} tokens -> "
                      f"x{g['time']:.1f} time{memory}", highlight=False)
    if json_out:
        json_out.write_text(json.dumps({"rows": rows, "growth": steps}, indent=1, default=str) + "\n")


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
    with status 1 when any length exceeds --tol. Ties at the indexer's top-k boundary (equal pool
    scores: repeats, all-zero ReLU scores) are counted, and the logits from the first tied position on
    are reported apart, since the two models may break the tie differently. Works for any glm5_next text config that
    genome-lm supports (NoPE MLA without attention bias, the tail pool always selected; any
    router grouping); other configs are refused with the field named."""
    from genome_lm.model.parity import run_parity

    sizes = [parse_size(x) for x in lengths.split(",") if x.strip()]
    if not hf.is_dir():
        _fail(GenomeLMError(f"{hf}: not a folder"))
    table = Table(title=f"genome-lm vs transformers on {hf}", title_justify="left")
    for column in ("T", "max |d logit|", "mean |d logit|", "max |d logprob|", f"<= {tol:g}", "tied queries",
                   "first tie", "max |d logit| after ties"):
        table.add_column(column, justify="right")

    def show(row):
        ties = (f" (before the first top-k tie at position {row.first_tie:,}; {row.tied_queries:,} tied queries)"
                if row.first_tie is not None else "")
        console.print(f"T={row.length:,}: max |d logit| {row.max_abs_logit:.3g}{ties}", highlight=False)

    try:
        with quiet_megatron_import_ctx():
            rows = run_parity(hf, sizes, tol=tol, seed=seed, kernel_backend=backend, progress=show)
    except GenomeLMError as exc:
        _fail(exc)
    for row in rows:
        after = "" if row.max_abs_logit_after_ties is None else f"{row.max_abs_logit_after_ties:.3g}"
        table.add_row(f"{row.length:,}", f"{row.max_abs_logit:.3g}", f"{row.mean_abs_logit:.3g}",
                      f"{row.max_abs_logprob:.3g}", "yes" if row.passed else "[bold red]NO[/]",
                      f"{row.tied_queries:,}", "" if row.first_tie is None else f"{row.first_tie:,}", after)
    console.print(table)
    if any(r.first_tie is not None for r in rows):
        console.print("tied queries: (DSA layer, query) pairs whose k-th and next-best pools score the same; "
                      "genome-lm keeps the lower pool, transformers what torch.topk returns, so the logits from the "
                      "first tie on may differ and are shown apart (parity is judged before it)", highlight=False)
    failed = [r.length for r in rows if not r.passed]
    if failed:
        Console(stderr=True).print(f"[bold red]parity failed[/] at T = {', '.join(map(str, failed))} (tolerance {tol:g})")
        raise typer.Exit(1)
    console.print(f"parity holds at every length (tolerance {tol:g})")


@app.command()
def finetune(
    config: Annotated[str, typer.Option(help="A config name from configs/ (demo-cpu, glm-5.3-flash-512k-64xb200, ...) or a YAML path.")] = "demo-cpu",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: --set train.steps=20 (repeatable).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the run folder's latest checkpoint.")] = False,
    resume_from: Annotated[Optional[str], typer.Option(help="Continue from this checkpoint (a folder, or its name such as step-000020) instead of the latest.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Start a new run in a folder that already holds one, deleting its checkpoints (without it, that is refused).")] = False,
    tracking_uri: Annotated[Optional[str], typer.Option(help="MLflow server (http://host:5000); default: a SQLite store in the run folder (also used when the server cannot be reached).")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    ray_address: Annotated[Optional[str], typer.Option(help="Train on a Ray cluster ('auto', host:port, or 'local' to start one here).")] = None,
    workers: Annotated[int, typer.Option(help="With --ray-address: ranks to start (one GPU each, or CPU workers without GPUs).", min=1)] = 1,
    cpus_per_worker: Annotated[int, typer.Option(help="With --ray-address: CPUs reserved per rank.", min=1)] = 1,
) -> None:
    """Fine-tune the model on a prepared dataset (megatron-core; tracked in MLflow).

    One process trains on this machine. For a node of GPUs start it with torchrun
    (`torchrun --nproc-per-node 8 -m genome_lm finetune --config ...`): every rank runs this
    command and the sizes in `parallel:` split the model. On a Ray cluster use --ray-address and
    --workers: one actor per GPU in a placement group, rank 0 reports. Checkpoints go to train.out_dir every
    train.save_every steps, at the end and on SIGTERM/Ctrl-C; --resume continues from the last."""
    from genome_lm.config import load_config
    from genome_lm.train.trainer import train

    try:
        cfg = load_config(config, set_ or [])
        with quiet_megatron_import_ctx():
            if ray_address is not None:
                from genome_lm.engine.launch import train_on_ray

                result = train_on_ray(cfg, address=ray_address, workers=workers, cpus_per_worker=cpus_per_worker,
                                      resume=resume, tracking_uri=tracking_uri, progress=not quiet,
                                      resume_from=resume_from, overwrite=overwrite)
            else:
                result = train(cfg, resume=resume, progress=not quiet, tracking_uri=tracking_uri,
                               resume_from=resume_from, overwrite=overwrite)
    except GenomeLMError as exc:
        _fail(exc)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 reports
        _print_training(result)


def _print_training(result) -> None:
    steps = result.all_steps
    if result.resumed_from is not None:
        console.print(f"resumed from step {result.resumed_from.name.split('-')[-1].lstrip('0') or '0'} "
                      f"({result.resumed_from})", highlight=False)
    if not steps:
        console.print("no steps run")
        return
    if not result.history:
        console.print(f"the run was already complete at step {result.steps_done}")
    first, last = steps[0], steps[-1]
    table = Table(title=f"fine-tuning in {result.out_dir}", title_justify="left")
    for column in ("steps", "first loss (step)", "last loss (step)", "change", "tokens/s", "peak host MiB"):
        table.add_column(column, justify="right")
    change = (last.lm_loss - first.lm_loss) / first.lm_loss * 100
    table.add_row(f"{result.steps_done}", f"{first.lm_loss:.4f} ({first.step})", f"{last.lm_loss:.4f} ({last.step})",
                  f"{change:+.1f}%", f"{last.tokens_per_s:,.0f}", f"{last.peak_host_mib:,.0f}")
    console.print(table)
    if result.stopped_by:
        console.print(f"stopped by {result.stopped_by}; continue with --resume", highlight=False)
    console.print(f"checkpoint: {result.checkpoint}", highlight=False)
    if result.tracking:
        console.print(f"MLflow: {result.tracking}", highlight=False)


@app.command()
def export(
    run: Annotated[Path, typer.Option(help="A training run folder (train.out_dir).")],
    out: Annotated[Path, typer.Option(help="Folder for the Hugging Face glm5_next safetensors.")],
    checkpoint: Annotated[Optional[str], typer.Option(help="Checkpoint folder name (default: the latest).")] = None,
    like: Annotated[Optional[Path], typer.Option(help="A Hugging Face checkpoint whose config.json and tensor dtypes to copy.")] = None,
) -> None:
    """Write a training checkpoint as Hugging Face glm5_next safetensors (sharded, with an index)."""
    from genome_lm.train.export import export_run

    try:
        with quiet_megatron_import_ctx():
            path = export_run(run, out, checkpoint=checkpoint, like=like)
    except GenomeLMError as exc:
        _fail(exc)
    console.print(f"wrote {path}", highlight=False)


@app.command()
def preflight(
    out: Annotated[Path, typer.Option(help="Where to write the JSON report (rewritten after each section).")] = Path(
        "preflight.json"),
    only: Annotated[Optional[str], typer.Option(
        help="Comma-separated sections: environment, compile, parity, speed, slice, resume.")] = None,
    dataset: Annotated[Optional[Path], typer.Option(
        help="A prepared dataset for the resume check (default: a small random one, which needs pysam).")] = None,
    quick: Annotated[bool, typer.Option(help="Time 32k only (the full check times 32k and 128k).")] = False,
) -> None:
    """Check one GPU before booking a cluster: versions, the kernels compiled for this GPU, each kernel against its reference at real shapes, KDA and DSA speed against fla and flash attention, the 4-layer slice's peak memory against the plan, and resume through the real trainer. On a CPU the same checks run at tiny shapes under Triton's interpreter."""
    import torch

    from genome_lm.preflight import SECTIONS, run_preflight

    sections = tuple(x.strip() for x in only.split(",")) if only else SECTIONS
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        raise typer.BadParameter(f"unknown section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}",
                                 param_hint="--only")
    if dataset is not None and not (dataset / "manifest.json").exists():
        _fail(GenomeLMError(f"{dataset}: not a prepared dataset (no manifest.json); make one with genome-lm prepare"))
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton when its kernels are defined: before any import
        console.print("no GPU: running at tiny shapes under Triton's interpreter (a check that every path runs)")
    status = {"ok": "[green]ok[/]", "fail": "[bold red]FAIL[/]", "skip": "[yellow]skipped[/]"}

    def show(section) -> None:
        console.print(f"{section.name}: {status[section.status]} ({section.seconds:.0f} s) {section.note}",
                      highlight=False)
        if section.rows:
            keys = [k for k in dict.fromkeys(k for r in section.rows for k in r) if k != "errors"]
            _print_rows(f"preflight: {section.name}", section.rows, {k: k for k in keys})

    report = run_preflight(out, only=sections, dataset=dataset, quick=quick, on_section=show)
    failed = [s["name"] for s in report["sections"] if s["status"] == "fail"]
    console.print(f"wrote {out}" + (f"; failed: {', '.join(failed)}" if failed else "; nothing failed"), highlight=False)
    if failed:
        raise typer.Exit(1)


# hardware planner (issue 7): genome_lm/plan/commands.py
from genome_lm.plan import commands as _plan_commands  # noqa: E402

app.command("plan")(_plan_commands.plan)
bench_app.command("sweep")(_plan_commands.bench_sweep)


def quiet_megatron_import_ctx():
    from genome_lm.engine import quiet_megatron_import

    return quiet_megatron_import()


def run() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
