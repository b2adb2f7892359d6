"""``genome-lm plan``: memory per GPU and host, and the step's time, for a config, before a run
(genome_lm.plan)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from genome_lm.engine.devices import SPECS
from genome_lm.errors import GenomeLMError
from genome_lm.plan.hardware import gpu_memory, gpu_spec

from .base import app, console, size

AND = " and\n"  # between the rows --write's note sets the best beside


@app.command("plan")
def plan(
    config: Annotated[Optional[str], typer.Option(help="A config in configs/ (e.g. glm-5.3-flash-1m-64xb200) or a YAML "
                                                       "path.")] = None,
    seq_len: Annotated[Optional[str], typer.Option(help="Tokens per sequence: 524288, 512k or 1M (default: the "
                                                        "config's).")] = None,
    tp: Annotated[Optional[int], typer.Option(help="Tensor parallel size.")] = None,
    cp: Annotated[Optional[int], typer.Option(help="Context parallel size.")] = None,
    ep: Annotated[Optional[int], typer.Option(help="Expert parallel size.")] = None,
    etp: Annotated[Optional[int], typer.Option(help="Expert tensor parallel size.")] = None,
    pp: Annotated[Optional[int], typer.Option(help="Pipeline parallel size (the plan is the busiest stage's).")] = None,
    recompute: Annotated[Optional[str], typer.Option(help="none, selective or full.")] = None,
    offload: Annotated[Optional[bool], typer.Option("--offload/--no-offload", help="Offload saved activations to host "
                                                                                   "memory.")] = None,
    optimizer_offload: Annotated[Optional[bool], typer.Option("--optimizer-offload/--no-optimizer-offload",
                                                              help="Optimizer state in host memory.")] = None,
    moe_chunks: Annotated[Optional[int], typer.Option(help="MoE layers in this many chunks.")] = None,
    peft: Annotated[Optional[str], typer.Option(help="none (full fine-tuning) or lora: adapters on a frozen base "
                                                     "(peft.method; the rest of the peft section as the config or "
                                                     "--set peft.* has it).")] = None,
    gpu: Annotated[str, typer.Option(help="B200 (180 GB), H200 (141 GB) or H100 (80 GB).")] = "B200",
    gpu_mem: Annotated[Optional[float], typer.Option(help="GPU memory in GB (overrides --gpu).")] = None,
    gpus: Annotated[Optional[int], typer.Option(help="GPUs in the run (default: the config's parallel.gpus, else tp "
                                                     "x cp x pp x global batch / micro batch, one micro-batch per "
                                                     "rank).")] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node, for host memory per node.")] = 8,
    moe_imbalance: Annotated[float, typer.Option(help="Busiest expert-parallel rank's tokens over the mean (4 on real "
                                                      "genome data).")] = 4.0,
    headroom: Annotated[float, typer.Option(
        help="Fraction of GPU memory kept free (CUDA context, NCCL, fragmentation).")] = 0.05,
    device: Annotated[str, typer.Option(help="gpu, or cpu for the torch path (offload moves nothing there; the memory "
                                             "of a rank is this machine's divided by the ranks on it, --gpus up to "
                                             "--gpus-per-node, unless --gpu-mem).")] = "gpu",
    sweep: Annotated[bool, typer.Option("--sweep", help="The table over sequence lengths 32k to 1M.")] = False,
    published: Annotated[bool, typer.Option("--published",
                                            help="The published run's figures next to the plan's.")] = False,
    kernel_efficiency: Annotated[Optional[float], typer.Option(
        help="Achieved fraction of the bf16 peak for the attention-like kernels (KDA, sparse attention, DSA "
             "indexer); default: the time model's, fitted on the published 1M run (genome-lm preflight sets the "
             "measured step of the 4-layer slice beside the predicted one on a GPU).")] = None,
    json_out: Annotated[bool, typer.Option("--json",
                                           help="Print the plan (memory and time) as JSON instead of tables.")] = False,
    plot: Annotated[Optional[str],
                    typer.Option(help="Write a bar chart of the step's time by part to this PNG.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set",
                                                      help="Override any config field: section.field=value.")] = None,
    search: Annotated[bool, typer.Option("--search", help="Rank every layout (TP, CP, PP, EP, ETP) and memory switch "
                                                          "(recompute, offload, MoE chunks) that fits --gpus (or the "
                                                          "config's parallel.gpus) of --gpu by predicted tokens/s, "
                                                          "beside the published run's setting and the config as "
                                                          "given; with --write, the best as a config.")] = False,
    top: Annotated[int, typer.Option(help="With --search: rows of the ranking to show.")] = 10,
    write: Annotated[Optional[Path], typer.Option(help="With --search: write the fastest candidate as a config YAML "
                                                       "here (the --config file with its parallel and memory sections "
                                                       "replaced).")] = None,
    eval_: Annotated[bool, typer.Option("--eval", help="Plan `genome-lm eval` instead of training: memory per GPU and "
                                                       "time of scoring windows of --seq-len with the config's layout "
                                                       "(no gradients, no optimizer), and the fewest GPUs of --gpu "
                                                       "whose layout fits.")] = False,
    score_context: Annotated[str, typer.Option(help="With --eval: the context genome-lm score's windows overlap by, "
                                                    "for the hours to score hg38 chr22 and the whole genome.")] = "8k",
) -> None:
    """Size the hardware before a run: memory per GPU (parameters, gradients, optimizer state,
    activations per layer type, what recompute and offload save) and host memory per node, from
    the same config the trainer reads. Flags a plan that does not fit the GPU and names the
    cheapest change that fits. On a GPU (--device gpu) also the step's time: step seconds,
    tokens/s for the cluster and per GPU, MFU, the time by layer type and by compute, memory,
    communication and host, and what bounds the step (docs/plan.md, "The time model")."""
    from genome_lm.config import load_config
    from genome_lm.plan.memory_model import estimate
    from genome_lm.plan.report import (
        config_label,
        print_plan,
        published_table,
        published_time_table,
        sweep_table,
        sweep_time_table,
        time_plot,
        time_table,
    )
    from genome_lm.plan.time_model import CONSTANTS, estimate_time

    if device not in ("gpu", "cpu"):
        raise GenomeLMError(f"--device {device}: expected gpu or cpu")
    if recompute not in (None, "none", "selective", "full"):
        raise GenomeLMError(f"--recompute {recompute}: expected none, selective or full")
    if peft not in (None, "none", "lora"):
        raise GenomeLMError(f"--peft {peft}: expected none or lora")
    if moe_imbalance < 1:
        raise GenomeLMError(f"--moe-imbalance {moe_imbalance}: the busiest rank has at least the mean (>= 1)")
    if not 0 <= headroom < 1:
        raise GenomeLMError(f"--headroom {headroom}: expected a fraction in [0, 1)")
    if plot is not None and not Path(plot).resolve().parent.is_dir():
        raise GenomeLMError(f"--plot {plot}: no folder {Path(plot).resolve().parent} to write it in")
    if kernel_efficiency is not None and not 0 < kernel_efficiency <= 1:
        raise GenomeLMError(f"--kernel-efficiency {kernel_efficiency}: expected a fraction in (0, 1]")
    constants = CONSTANTS if kernel_efficiency is None else replace(CONSTANTS, kernel=kernel_efficiency)

    def hardware(count: int | None) -> tuple:
        return _hardware(gpu, gpu_mem, count, gpus_per_node, device, moe_imbalance, headroom)

    if published:
        spec, hw = hardware(gpus)
        console.print(published_table(hw))
        console.print("The plan is of the shipped configs as they are (the DSA selection shared out), not of the "
                      "published run's setting; differences over 20% are explained in docs/plan.md.")
        console.print(published_time_table(hw, constants))
        console.print("The time model fits one constant (the kernel efficiency) on the 1M figure; the other rows "
                      "are predictions (docs/plan.md, \"The time model\").")
        return
    if config is None:
        raise GenomeLMError("--config is required (a shipped config name or a YAML path)")
    fields = {"data.seq_len": size(seq_len, "--seq-len"), "parallel.tp": tp, "parallel.cp": cp, "parallel.ep": ep,
              "parallel.etp": etp, "parallel.pp": pp, "memory.recompute": recompute,
              "memory.offload_activations": offload, "memory.optimizer_offload": optimizer_offload,
              "memory.moe_chunks": moe_chunks, "peft.method": peft}
    options = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items() if v is not None]
    # the command states the GPU count: the config's parallel.gpus gives way
    override = ["parallel.gpus=null"] if gpus is not None else []
    run = load_config(config, [*(set_ or []), *options, *override])  # validated like the trainer's config
    label = config_label(config, run, load_config(config, override))  # how the tables name it
    spec, hw = hardware(gpus or run.parallel.gpus)
    if write is not None and not search:
        raise GenomeLMError("--write goes with --search (it writes the search's best config)")
    if search:
        if spec is None:
            raise GenomeLMError("--search ranks by the time model, which is for GPUs (--device gpu, a known --gpu)")
        if not hw.gpus:
            raise GenomeLMError("--search needs --gpus: the cluster to lay the run out on (e.g. --gpus 64), where the "
                                "config states no parallel.gpus")
        if top < 1:
            raise GenomeLMError(f"--top {top}: expected at least 1 row")
        if write is not None and not write.resolve().parent.is_dir():
            raise GenomeLMError(f"--write {write}: no folder {write.resolve().parent} to write it in")
        _plan_search(run, config, label, hw, spec, constants, json_out, top, write)
        return
    if eval_:
        _plan_eval(run, hw, spec, constants, json_out, size(score_context, "--score-context"))
        return
    if sweep:
        console.print(sweep_table(run, hw))
        if spec is not None:
            console.print(sweep_time_table(run, hw, spec, constants))
        return
    memory_plan = estimate(run, hw)
    timing = estimate_time(run, hw, spec, constants) if spec is not None else None
    if plot is not None:
        if timing is None:
            raise GenomeLMError("--plot: the time model is for GPUs (--device gpu)")
        time_plot(timing, plot)
    if json_out:
        out = {"config": config, "gpu": hw.gpu_name, "gpus": memory_plan.gpus, "fits": memory_plan.fits,
               "peak_bytes": memory_plan.peak, "usable_bytes": memory_plan.usable, "peak_where": memory_plan.peak_where,
               "device": [vars(i) for i in memory_plan.device], "host": [vars(i) for i in memory_plan.host],
               "time": None if timing is None else {**timing.as_dict(), "constants": vars(constants)}}
        typer.echo(json.dumps(out, indent=2))
        return
    print_plan(memory_plan, hw, console)
    if timing is not None:
        console.print(time_table(timing, label, _published_setting(run, hw, spec, constants)))
    if plot is not None:
        console.print(f"wrote {plot}")


def _hardware(gpu: str, gpu_mem: float | None, gpus: int | None, gpus_per_node: int, device: str,
              moe_imbalance: float, headroom: float) -> tuple:
    """(the GPU kind for the time model or None, the ``Hardware`` to plan on) from the options."""
    from genome_lm.plan.memory_model import Hardware

    name, mem_bytes = gpu_memory(gpu, gpu_mem)
    if device == "cpu" and gpu_mem is None:  # a rank's share of this machine's memory
        ranks = min(gpus or 1, gpus_per_node)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        name, mem_bytes = f"CPU rank ({ram / 2**30:.1f} GiB here / {ranks})", ram / ranks
    # the time model needs a known GPU kind; --gpu-mem with another --gpu plans memory alone
    spec = None
    if device == "gpu" and (gpu_mem is None or gpu.upper() in SPECS):
        spec = replace(gpu_spec(gpu), memory=mem_bytes)
    return spec, Hardware(gpu_name=name, gpu_bytes=mem_bytes, gpus=gpus, gpus_per_node=gpus_per_node, device=device,
                          moe_imbalance=moe_imbalance, headroom=headroom)


def _published_setting(run, hw, spec, constants) -> tuple | None:
    """(the published run's setting in words, its timing) for a config the published run ran
    with another setting (the shipped ones share the DSA selection out), else None."""
    from genome_lm.plan.memory_model import with_changes
    from genome_lm.plan.published import PUBLISHED_TIME_SETTING, published_config, setting_words
    from genome_lm.plan.time_model import estimate_time

    name, words = published_config(run), setting_words(run)
    if spec is None or name is None or not words:
        return None
    return f"{name} with {words}", estimate_time(with_changes(run, **PUBLISHED_TIME_SETTING), hw, spec, constants)


def _plan_eval(run, hw, spec, constants, json_out: bool, score_context: int = 8192) -> None:
    """``plan --eval``: the config's layout, and the smallest that fits (``plan.eval_model``), with
    the hours ``genome-lm score`` takes over hg38 chr22 and the genome on each."""
    from genome_lm.plan.eval_model import HG38_CHR22, HG38_GENOME, estimate_eval, score_time, smallest_eval_layout
    from genome_lm.plan.memory_model import with_changes
    from genome_lm.plan.report import gib, length_label

    p = run.parallel
    hw_here = hw if hw.gpus else replace(hw, gpus=max(p.tp * p.cp, p.ep * p.etp))
    here = estimate_eval(with_changes(run, parallel={"pp": 1}), hw_here, spec, constants)
    best = smallest_eval_layout(run, replace(hw, gpus=None), spec)
    def scoring(plan):
        if plan is None or not plan.time:
            return []
        return [score_time(plan, name, bases, score_context)
                for name, bases in (("hg38 chr22", HG38_CHR22), ("hg38 chr1-22, X, Y", HG38_GENOME))]

    if json_out:
        typer.echo(json.dumps({"layout": here.as_dict(), "smallest": None if best is None else best.as_dict(),
                               "score": {"context": score_context,
                                         "layout": [vars(t) for t in scoring(here)],
                                         "smallest": [vars(t) for t in scoring(best)]}}, indent=2))
        return
    T = run.data.seq_len
    for title, plan in ((f"eval of {length_label(T)}-token windows on {hw.gpu_name}: {here.layout_text()}", here),
                        (f"the fewest {hw.gpu_name} GPUs that fit: {best.layout_text()}" if best else None, best)):
        if plan is None:
            console.print(f"no layout of up to 256 {hw.gpu_name} GPUs fits the eval of {length_label(T)}-token windows")
            continue
        table = Table(title=title, title_justify="left")
        table.add_column("per GPU")
        table.add_column("GiB", justify="right")
        table.add_column("")
        for item in plan.memory:
            table.add_row(item.name, gib(item.bytes), item.note)
        verdict = "fits" if plan.fits else "does NOT fit"
        table.add_row("peak", gib(plan.peak), f"{verdict} in {gib(plan.hw.usable)} GiB usable", style="bold")
        console.print(table)
        if plan.time:
            console.print(f"  one window: {plan.window_seconds:,.1f} s on {plan.gpus // plan.groups} GPUs; "
                          f"{plan.groups} window(s) at once; {plan.tokens_per_s:,.0f} tokens/s "
                          f"({3_600 * plan.tokens_per_s / 1e6:,.0f} Mbp an hour)", highlight=False)
        for t in scoring(plan):
            console.print(f"  genome-lm score of {t.name} ({t.bases / 1e6:,.1f} Mbp, windows overlapping by "
                          f"{length_label(score_context)}): {t.hours:,.1f} h on {plan.gpus} GPUs; embeddings "
                          f"{t.embedding_bytes / 1e9:,.0f} GB a layer (float16, per base)", highlight=False)



def _plan_search(run, config: str, label: str, hw, spec, constants, json_out: bool, top: int,
                 write: Path | None) -> None:
    """``plan --search``: the fitting candidates fastest first, beside the published run's setting
    and the config as given, each named (the shipped configs are not the published setting), and
    what separates the best from the published setting (``plan.search``)."""
    from genome_lm.config import find_config
    from genome_lm.plan.published import published_label, setting_words
    from genome_lm.plan.report import gib, is_shipped, length_label
    from genome_lm.plan.search import config_yaml, differences
    from genome_lm.plan.search import search as run_search

    found = run_search(run, hw, spec, constants)
    best = next(c for c in found if c.fits and not c.label)
    published = next((c for c in found if c.label == "published"), None)
    given = next((c for c in found if c.label == "config"), None)
    tag, published_name = published_label(run, label)
    tags = {"published": tag, "config": "the shipped config" if is_shipped(config) else "the config as given"}
    T = length_label(run.data.seq_len)
    lora = run.peft.method == "lora"
    if write is not None:
        against = [f"{c.tokens_per_s:,.0f} for {name}" for c, name in ((published, published_name), (given, label))
                   if c is not None]
        versus = f", against\n{AND.join(against)}" if against else \
            f"\n(the config's layout does not split {hw.gpus} GPUs: nothing to set beside it)"
        sections = "parallel, memory and peft sections" if lora else "parallel and memory sections"
        note = (f"Written by `genome-lm plan --config {config} --seq-len {T} --gpus {hw.gpus} --gpu {spec.name} "
                f"{'--peft lora ' if lora else ''}--search`:\nthe fastest layout that fits: {best.tokens_per_s:,.0f} "
                f"tokens/s predicted{versus}.\nIts {sections} come from the search; the rest from {config}.")
        text = config_yaml(find_config(config).read_text(), best, note)
        tmp = write.with_name(write.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(write)
    if json_out:
        typer.echo(json.dumps({"gpus": hw.gpus, "gpu": spec.name, "seq_len": run.data.seq_len,
                               "candidates": [c.as_dict() for c in found],
                               "written": None if write is None else str(write)}, indent=2))
        return
    how = f", LoRA rank {run.peft.rank} on a frozen base" if lora else ""
    table = Table(title=f"{T}-token sequences on {hw.gpus} x {spec.name}{how}: layouts that fit, fastest first "
                        f"(predicted; docs/plan.md)", title_justify="left")
    # against the published setting where it splits these GPUs, else against the best
    reference, versus = (published, tag.removeprefix("the ")) if published is not None else (best, "the best")
    for col, justify in (("#", "right"), ("layout", "left"), ("memory switches", "left"), ("GiB/GPU", "right"),
                         ("tokens/s", "right"), (f"vs {versus}", "right"), ("bound by", "left")):
        table.add_column(col, justify=justify)
    shown = found[:top] + [c for c in found[top:] if c.label]  # the two named rows, wherever they rank
    for c in shown:
        fits = "" if c.fits else " (does not fit)"
        tag_cell = escape(f" [{tags[c.label]}]") if c.label else ""  # rich would read [...] as markup
        table.add_row(str(found.index(c) + 1), c.layout() + tag_cell, c.memory(),
                      gib(c.peak) + fits, f"{c.tokens_per_s:,.0f}", f"x{c.tokens_per_s / reference.tokens_per_s:.2f}",
                      c.bound(), style="bold" if c is best else ("italic" if c.label else None))
    console.print(table)
    console.print(f"{sum(1 for c in found if not c.label)} candidates fit. Beside them:", highlight=False)
    p = run.parallel
    if published is not None:
        console.print(f"  {published_name}: {published.tokens_per_s:,.0f} tokens/s (#{found.index(published) + 1})",
                      highlight=False)
    else:
        console.print(f"  {published_name}: its layout (TP {p.tp} x CP {p.cp}, EP {p.ep} x ETP {p.etp}"
                      f"{f' x PP {p.pp}' if p.pp > 1 else ''}) does not split {hw.gpus} GPUs", highlight=False)
    if given is not None:
        console.print(f"  {label}: {given.tokens_per_s:,.0f} tokens/s (#{found.index(given) + 1})", highlight=False)
    elif setting_words(run) and published is not None:
        console.print(f"  {label}: its layout does not split {hw.gpus} GPUs or its batch", highlight=False)
    if published is not None:
        console.print(f"The best against {tag}, the parts that differ most (seconds a step):", highlight=False)
        for name, a, b in differences(best.timing, published.timing):
            console.print(f"  {name}: {a:,.1f} s against {b:,.1f} s", highlight=False)
    if write is not None:
        console.print(f"wrote {write}")
