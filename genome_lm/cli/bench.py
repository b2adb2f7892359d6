"""``genome-lm bench``: kernels, the whole model, and the memory sweep, each against a baseline
measured in the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from genome_lm.compare.bench import bench, check_indexer_loss, default_threads, growth, kernel_bench
from genome_lm.errors import GenomeLMError
from genome_lm.model.presets import PRESETS

from .base import bench_app, console, print_rows, sizes


@bench_app.command("kernels")
def bench_kernels(
    seq_lens: Annotated[str, typer.Option(help="Comma-separated sequence lengths (k=1024).")] = "8k,32k,128k",
    op: Annotated[str, typer.Option(help="Which ops: kda, dsa or all.")] = "all",
    backward: Annotated[bool, typer.Option(help="Time KDA forward+backward too (slow for the reference).")] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json",
                                                     help="Also write every row, all fields, to this file.")] = None,
    compile_for: Annotated[Optional[str], typer.Option(
        help="Instead of timing: compile every Triton kernel for these GPU targets (sm_90, sm_100; no GPU "
             "needed) at the shipped configs' per-rank shapes and report shared memory, registers, spills, "
             "tensor-core instructions and compile time. Exits 1 if a kernel would not launch or spills.")] = None,
) -> None:
    """KDA chunked vs its token-by-token reference (and transformers' torch fallback); DSA sparse vs dense masked
    attention: time and peak memory on this machine, with the ratio to the baseline."""
    if op not in ("kda", "dsa", "all"):
        raise typer.BadParameter("choose kda, dsa or all", param_hint="--op")
    if compile_for:
        _compile_check(compile_for, op, json_out)
        return
    results = kernel_bench(op, tuple(sizes(seq_lens, "--seq-lens")), backward=backward)
    if "kda" in results:
        print_rows("KDA (time relative to the chunked torch path)", results["kda"],
                   {"impl": "path", "mode": "mode", "T": "T", "seconds": "seconds", "x torch time": "x torch time",
                    "peak_mib": "peak MiB", "note": "note"})
    if "dsa" in results:
        print_rows("DSA forward+backward (relative to the sparse path)", results["dsa"],
                   {"path": "path", "T": "T", "time_s": "seconds", "x sparse time": "x sparse time",
                    "peak_mib": "peak MiB", "kib_per_token": "KiB/token", "x sparse memory": "x sparse mem",
                    "note": "note"})
    if json_out:
        json_out.write_text(json.dumps(results, indent=1, default=str) + "\n")


def _compile_check(targets: str, op: str, json_out: Path | None) -> None:
    from genome_lm_kernels.compile_check import TARGETS, run_in_subprocess

    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise typer.BadParameter(f"unknown target {', '.join(unknown) or targets!r}; choose from {', '.join(TARGETS)}",
                                 param_hint="--compile-for")
    with console.status(f"compiling every kernel for {', '.join(names)} (about a minute per target)"):
        rows = run_in_subprocess(names, "kda,dsa" if op == "all" else op)
    for row in rows:
        spills = row["spill_stores"] or row["spill_loads"] or row["local_bytes"]
        row["problem"] = "; ".join(row["problems"]) or ("spills (fp32 parity mode)" if spills else "")
    print_rows("Triton kernels compiled for the target (nothing launched; registers, spills and stack from ptxas -v)",
               rows, {"target": "target", "case": "op and shape", "kernel": "kernel", "shared_bytes": "shared B",
                      "registers": "regs", "spill_stores": "spill st B", "spill_loads": "spill ld B",
                      "local_bytes": "stack B", "mma": "tensor-core ops", "compile_s": "compile s",
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
    repeats: Annotated[int, typer.Option(help="Timed steps after the warm-up (fewer once 30 s of steps have run); the "
                                              "median is shown.", min=1)] = 3,
    threads: Annotated[Optional[int], typer.Option(help="torch threads in every run; default: the cores this process "
                                                        "may use.", min=1)] = None,
    batch: Annotated[int, typer.Option(help="Sequences per step (the long recipe's first stage: --batch 8 --seq-lens "
                                            "256).", min=1)] = 1,
    indexer_loss: Annotated[str, typer.Option(
        help="Also compute genome-lm's DSA indexer loss in each step, as training with train.indexer_loss does: "
             "off, dense (the long recipe) or sparse. Not with --compare-transformers (glm5_next has none).")] = "off",
    timeout: Annotated[float, typer.Option(help="Seconds allowed per run (model build + warm-up + timed steps); "
                                                "transformers reports 'timeout' past it.")] = 1200.0,
    json_out: Annotated[Optional[Path], typer.Option("--json",
                                                     help="Also write every row, all fields, to this file.")] = None,
) -> None:
    """Forward+backward of the whole model (batch 1, random DNA, next-token loss): seconds, tokens/s and peak memory per
    length, and the speed-up over transformers' glm5_next on the same weights."""
    if preset not in PRESETS:
        raise typer.BadParameter(f"choose from {', '.join(PRESETS)}", param_hint="--preset")
    lengths = tuple(sizes(seq_lens, "--seq-lens"))
    try:
        check_indexer_loss(indexer_loss, compare_transformers)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--indexer-loss") from None
    threads = threads or default_threads()
    console.print(f"torch threads: {threads}", highlight=False)

    def show(row):
        done = f"{row['seconds']:.3g} s" if row.get("seconds") else row.get("note", "")
        console.print(f"{row['impl']} T={row['T']:,}: {done}", highlight=False)

    try:
        rows = bench(preset, lengths, compare_transformers=compare_transformers, repeats=repeats, threads=threads,
                     timeout_s=timeout, batch=batch, indexer_loss=indexer_loss, progress=show)
    except RuntimeError as exc:
        raise GenomeLMError(str(exc)) from None
    shown = [dict(r, note=None if r.get("note") == "measured" else r.get("note"), loss=None, backend=None,
                  warmup_s=None, repeats=None) for r in rows]
    print_rows(f"{preset}: forward+backward, batch {batch}, median of up to {repeats} steps", shown,
               {"T": "T", "impl": "path", "seconds": "seconds", "tokens_per_s": "tokens/s", "peak_mib": "peak MiB",
                "speedup": "speed-up", "note": "note"})
    console.print("speed-up = transformers seconds / genome-lm seconds; "
                  + "; ".join(sorted({f"{r['impl']}: {r['backend']}" for r in rows if r.get("backend")})),
                  highlight=False)
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


@bench_app.command("sweep")
def bench_sweep(
    lengths: Annotated[str, typer.Option(help="Comma-separated sequence lengths (k, M suffixes).")] = "4k,8k,16k,32k",
    settings: Annotated[str, typer.Option(help="Comma-separated memory settings: plain, selective, recompute, nested, "
                                               "moe-chunks, offload, recompute+offload.")
                        ] = "plain,selective,recompute,nested",
    threads: Annotated[int, typer.Option(help="torch threads per measured step.")] = 2,
    out: Annotated[Path, typer.Option(help="Folder for sweep.json and sweep.png.")] = Path("runs/bench-sweep"),
) -> None:
    """Throughput and peak memory of one training step of the tiny model on this CPU, per
    sequence length and memory setting, next to the planner's prediction; writes a JSON table
    and a PNG (tokens/s and peak memory against length, one line per setting)."""
    from genome_lm.plan.sweep import SETTINGS, plot, run_sweep, sweep_rows_table

    names = [s.strip() for s in settings.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        raise GenomeLMError(f"--settings: unknown {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    rows = run_sweep(names, sizes(lengths, "--lengths"), threads, out, progress=console)
    console.print(sweep_rows_table(rows))
    png = plot(rows, out / "sweep.png")
    console.print(f"wrote {out / 'sweep.json'} and {png}", highlight=False)
