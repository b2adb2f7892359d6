"""Checks: ``parity`` against transformers' glm5_next and ``preflight`` on one GPU (or this CPU)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from genome_lm.engine import quiet_megatron_import
from genome_lm.engine.backend import current, on_gpu
from genome_lm.errors import GenomeLMError
from genome_lm.preflight import SECTIONS, run_preflight

from .base import app, console, print_rows, sizes

# parity's default bound for the tensor-core backends: bf16 operands round each product's inputs
# by 2^-9 relative; measured on the shipped tiny-long model against transformers' fp32 model,
# max |d logit| 0.034 at T = 257 and 0.0065 at T = 1,000 before the first flip (issue 27)
HALF_PRECISION_TOL = 5e-2


@app.command()
def parity(
    hf: Annotated[Path, typer.Option("--hf", help="A glm5_next checkpoint folder written by transformers' "
                                                  "save_pretrained.")],
    lengths: Annotated[str,
                       typer.Option(help="Comma-separated sequence lengths (k=1024).")] = "1,63,64,65,257,1000,4096",
    tol: Annotated[Optional[float], typer.Option(
        help="Largest allowed |logit difference| before the first tie or flip (default: 1e-4 for the fp32 "
             "backends; 0.05 for triton and fla, whose bf16 products round each KDA and MLA output by "
             "about 2^-9 relative, measured 0.034 on the shipped tiny-long model at T = 257).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random DNA tokens.")] = 0,
    backend: Annotated[str, typer.Option(
        help="Kernel backend of genome-lm's model: auto, torch, triton, reference.")] = "auto",
) -> None:
    """Check genome-lm's model against transformers' glm5_next on the same checkpoint.

    Loads the checkpoint in transformers and through genome-lm's loader, runs both on the same
    random DNA tokens at each length, prints the largest |logit difference| per length, and exits
    with status 1 when any length exceeds --tol. Ties at the indexer's top-k boundary (equal pool
    scores: repeats, all-zero ReLU scores) are counted, and the logits from the first tied position on
    are reported apart, since the two models may break the tie differently. With a GPU backend
    (triton: bf16 tensor-core products) the MoE routing and DSA selection are also compared with
    genome-lm's torch path on the same input; decisions that flip on near-ties are listed with
    their margins, and parity is judged before the first one. Works for any glm5_next text config that
    genome-lm supports (NoPE MLA without attention bias, the tail pool always selected; any
    router grouping); other configs are refused with the field named."""
    from genome_lm.compare.parity import run_parity
    from genome_lm_kernels import resolve_backend

    lengths_ = sizes(lengths, "--lengths")
    if not hf.is_dir():
        raise GenomeLMError(f"{hf}: not a folder")
    try:
        resolved = resolve_backend(backend, current().device)
    except ValueError as err:
        raise GenomeLMError(f"--backend {backend}: {err}") from None
    if tol is None:
        tol = HALF_PRECISION_TOL if resolved.gpu and not resolved.exact else 1e-4
    table = Table(title=f"genome-lm vs transformers on {hf}", title_justify="left")
    for column in ("T", "max |d logit|", "mean |d logit|", "max |d logprob|", f"<= {tol:g}", "tied queries",
                   "first tie", "routing flips", "selection flips", "first flip", "max |d logit| after"):
        table.add_column(column, justify="right")

    def show(row):
        why = []
        if row.first_tie is not None:
            why.append(f"the first top-k tie at position {row.first_tie:,}; {row.tied_queries:,} tied queries")
        if row.first_flip is not None:
            why.append(f"the first flip at position {row.first_flip:,}; {row.routing_flips:,} routing and "
                       f"{row.selection_flips:,} selection flips")
        before = f" (before {' and '.join(why)})" if why else ""
        console.print(f"T={row.length:,}: max |d logit| {row.max_abs_logit:.3g}, max |d logprob| "
                      f"{row.max_abs_logprob:.3g}{before}", highlight=False)

    with quiet_megatron_import():
        rows = run_parity(hf, lengths_, tol=tol, seed=seed, kernel_backend=backend, progress=show)
    for row in rows:
        after = "" if row.max_abs_logit_after is None else f"{row.max_abs_logit_after:.3g}"
        table.add_row(f"{row.length:,}", f"{row.max_abs_logit:.3g}", f"{row.mean_abs_logit:.3g}",
                      f"{row.max_abs_logprob:.3g}", "yes" if row.passed else "[bold red]NO[/]",
                      f"{row.tied_queries:,}", "" if row.first_tie is None else f"{row.first_tie:,}",
                      f"{row.routing_flips:,}", f"{row.selection_flips:,}",
                      "" if row.first_flip is None else f"{row.first_flip:,}", after)
    console.print(table)
    if any(r.first_tie is not None for r in rows):
        console.print("tied queries: (DSA layer, query) pairs whose k-th and next-best pools score the same; "
                      "genome-lm keeps the lower pool, transformers what torch.topk returns, so the logits from the "
                      "first tie on may differ and are shown apart (parity is judged before it)", highlight=False)
    flipped = [(r.length, f) for r in rows for f in r.flips]
    if flipped:
        flips = Table(title="flips against genome-lm's torch path (the first ones per length): decisions on near-ties "
                            "that this backend's rounding turns the other way; parity is judged before the first",
                      title_justify="left")
        for column in ("T", "position", "kind", "layer", "margin on the torch path"):
            flips.add_column(column, justify="right" if column != "kind" else "left")
        for length, f in flipped:
            flips.add_row(f"{length:,}", f"{f.position:,}", f.kind, str(f.layer), f"{f.margin:.2g}")
        console.print(flips)
    failed = [r.length for r in rows if not r.passed]
    if failed:
        Console(stderr=True).print(f"[bold red]parity failed[/] at T = {', '.join(map(str,
                                                                                      failed))} (tolerance {tol:g})")
        raise typer.Exit(1)
    console.print(f"parity holds at every length (tolerance {tol:g})")


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
    """Check one GPU before booking a cluster: versions, the kernels compiled for this GPU, each kernel against its
    reference at real shapes, KDA and DSA speed against fla and flash attention, the 4-layer slice's peak memory against
    the plan, and resume through the real trainer. On a CPU the same checks run at tiny shapes under Triton's
    interpreter."""

    sections = tuple(x.strip() for x in only.split(",")) if only else SECTIONS
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        raise typer.BadParameter(f"unknown section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}",
                                 param_hint="--only")
    if dataset is not None and not (dataset / "manifest.json").exists():
        raise GenomeLMError(f"{dataset}: not a prepared dataset (no manifest.json); make one with genome-lm prepare")
    if not on_gpu():
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton when its kernels are defined: before any import
        console.print("no GPU: running at tiny shapes under Triton's interpreter (a check that every path runs)")
    status = {"ok": "[green]ok[/]", "fail": "[bold red]FAIL[/]", "skip": "[yellow]skipped[/]"}

    def show(section) -> None:
        console.print(f"{section.name}: {status[section.status]} ({section.seconds:.0f} s) {section.note}",
                      highlight=False)
        if section.rows:
            keys = [k for k in dict.fromkeys(k for r in section.rows for k in r) if k != "errors"]
            print_rows(f"preflight: {section.name}", section.rows, {k: k for k in keys})

    report = run_preflight(out, only=sections, dataset=dataset, quick=quick, on_section=show)
    failed = [s["name"] for s in report["sections"] if s["status"] == "fail"]
    console.print(f"wrote {out}" + (f"; failed: {', '.join(failed)}" if failed else "; nothing failed"),
                  highlight=False)
    if failed:
        raise typer.Exit(1)
