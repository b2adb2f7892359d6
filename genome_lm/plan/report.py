"""Tables for ``genome-lm plan``: the per-GPU budget, the fit check and the cheapest change that
fits, the sweep over sequence lengths, and the published-run comparison."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from genome_lm.config import CONFIG_DIR, RunConfig, find_config
from genome_lm.errors import GenomeLMError
from genome_lm.units import size_label

from .memory_model import GiB, Hardware, Plan, busiest, estimate, with_changes, world_size

SWEEP_LENGTHS = [32768 * 2**i for i in range(6)]  # 32k .. 1M
SHOWN = 0.005 * GiB  # less than this reads 0.00 GiB in the tables


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:,.2f}"


def effect(nbytes: float, per: str = "") -> str:
    """Bytes a switch saves, in words: "saves 2.00 GiB", "costs 2.00 GiB" where negative, or
    "unchanged" where the tables would show 0.00."""
    if abs(nbytes) < SHOWN:
        return "unchanged"
    return f"{'saves' if nbytes > 0 else 'costs'} {gib(abs(nbytes))} GiB{per}"


def is_shipped(config: str) -> bool:
    return find_config(config).resolve().parent == CONFIG_DIR.resolve()


def config_label(config: str, run: RunConfig | None = None, written: RunConfig | None = None) -> str:
    """How the tables name the config a plan is of: "the shipped config NAME" (one of configs/)
    or "the config PATH", and how ``run`` differs from it as ``written``: at another length, or
    otherwise changed by the command's options."""
    label = f"the shipped config {find_config(config).stem}" if is_shipped(config) else f"the config {config}"
    if run is None or run == written:
        return label
    if run == with_changes(written, data={"seq_len": run.data.seq_len}):
        return f"{label} at {length_label(run.data.seq_len)}"
    return f"{label} with this command's changes"


def length_label(n: int) -> str:
    return size_label(n)


def _stage_label(plan: Plan) -> str:
    if plan.stages == 1:
        return ""
    layers = (f"layer {plan.layers.start}" if len(plan.layers) == 1 else
              f"layers {plan.layers.start}-{plan.layers.stop - 1}")
    return (f", pp {plan.stages} (stage {plan.stage}, {layers}, "
            f"{plan.in_flight} micro-batch{'es' if plan.in_flight > 1 else ''} in flight)")


def budget_table(plan: Plan) -> Table:
    run, p = plan.run, plan.run.parallel
    nested = " nested" if run.memory.recompute == "full" and run.memory.recompute_nested else ""
    lora = f"; LoRA rank {run.peft.rank} on a frozen base" if run.peft.method == "lora" else ""
    title = (f"{run.model.preset} at {length_label(run.data.seq_len)} tokens on {plan.gpus} x {plan.hw.gpu_name}: "
             f"tp {p.tp}, cp {p.cp}, ep {p.ep}, etp {p.etp}{_stage_label(plan)}; recompute {run.memory.recompute}"
             f"{nested}, offload {'on' if run.memory.offload_activations else 'off'}, "
             f"optimizer offload {'on' if run.memory.optimizer_offload else 'off'}{lora}")
    table = Table(title=title, title_justify="left")
    table.add_column("per GPU", style="bold")
    table.add_column("GiB", justify="right")
    table.add_column("note")
    for item in plan.device:
        table.add_row(item.name, gib(item.bytes), item.note)
    table.add_row("peak", gib(plan.peak), f"of {gib(plan.usable)} usable ({plan.hw.headroom:.0%} kept free)",
                  style="bold green" if plan.fits else "bold red")
    table.add_section()
    table.add_row("[italic]activations saved per layer, before recompute/offload[/italic]", "", "")
    for item in plan.activations:
        table.add_row(item.name, gib(item.bytes), item.note)
    if plan.savings:
        table.add_section()
        table.add_row("[italic]each switch against the same run without it (GiB: what it saves on the GPU's peak)"
                      "[/italic]", "", "")
        for s in plan.savings:
            table.add_row(f"{s.switch} (vs {s.against})", gib(s.gpu if abs(s.gpu) >= SHOWN else 0.0),
                          f"GPU peak: {effect(s.gpu)}; host: {effect(s.host, ' per GPU')}")
    if plan.host:
        table.add_section()
        for item in plan.host:
            table.add_row(f"host: {item.name}", gib(item.bytes), item.note)
        table.add_row("host per GPU", gib(plan.host_per_gpu), "")
        table.add_row("host per node", gib(plan.host_per_node), f"{min(plan.gpus,
                                                                       plan.hw.gpus_per_node)} GPUs per node")
    return table


@dataclass
class Suggestion:
    change: str
    plan: Plan


MAX_CP_FACTOR = 8  # the most a suggestion multiplies context parallel by
MAX_PP = 16  # the most pipeline stages a suggestion tries


# Memory switches in order of what they cost in step time (cheapest first); each maps a run to a
# changed run on the same GPUs.
def _ladder(run: RunConfig) -> list[tuple[str, dict]]:
    mem = run.memory
    steps = []
    if mem.dsa_query_chunk and mem.dsa_query_chunk > 1024:  # the indexer's [chunk, T / kpool] blocks
        steps.append(("DSA query chunk 1024", {"memory": {"dsa_query_chunk": 1024}}))
    if not mem.optimizer_offload:
        steps.append(("optimizer offload", {"memory": {"optimizer_offload": True}}))
    if mem.recompute == "none":
        steps.append(("selective recompute of attention", {"memory": {"recompute": "selective",
                                                                       "recompute_modules": ["attention"]}}))
    if mem.recompute != "full":
        steps.append(("full recompute", {"memory": {"recompute": "full"}}))
    if not getattr(mem, "recompute_nested", True):
        steps.append(("nested recompute", {"memory": {"recompute": "full", "recompute_nested": True}}))
    if not mem.offload_activations:
        steps.append(("activation offload", {"memory": {"offload_activations": True}}))
    return steps


def _more_gpus(run: RunConfig) -> list[tuple[list[str], dict]]:
    """More context parallel (x2, x4 .. x MAX_CP_FACTOR) and/or more pipeline stages (up to
    MAX_PP), each at the same data-parallel size, so each multiplies the GPUs: (names, changes)
    in order of the GPUs they take, then of the pipeline stages (each adds to the bubble)."""
    p = run.parallel
    options = []
    for factor in (2**i for i in range(MAX_CP_FACTOR.bit_length())):  # 1, 2, 4, 8
        for pp in range(p.pp, MAX_PP + 1):
            if factor == 1 and pp == p.pp:
                continue
            names = ([f"context parallel {p.cp * factor}"] if factor > 1 else []) + \
                    ([f"pipeline parallel {pp}"] if pp != p.pp else [])
            options.append((factor * pp, pp, names, {"parallel": {"cp": p.cp * factor, "pp": pp}}))
    return [(names, changes) for *_, names, changes in sorted(options, key=lambda o: o[:2])]


def _merge(a: dict, b: dict) -> dict:
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, {}).update(v)
    return out


def suggest(run: RunConfig, hw: Hardware) -> Suggestion | None:
    """The cheapest change that fits, in this order: one memory switch (cheapest first); more
    context parallel or more pipeline stages alone (fewest GPUs first); the memory switches
    added one by one; all of them with more GPUs (fewest first). More context parallel or
    pipeline parallel keeps the data-parallel size, so it multiplies the GPUs. A pipeline size
    that cannot split the model's layers is skipped."""
    p = run.parallel
    base = world_size(run, hw)  # --gpus, the config's parallel.gpus or one micro-batch per rank

    def try_(changes: dict) -> Plan | None:
        try:
            changed = with_changes(run, **changes)
            q = changed.parallel
            gpus = base // (p.cp * p.pp) * q.cp * q.pp
            plan = busiest(changed, Hardware(**{**hw.__dict__, "gpus": gpus}))
        except GenomeLMError:
            return None
        return plan if plan.fits else None

    ladder, more = _ladder(run), _more_gpus(run)
    for name, changes in ladder:
        if plan := try_(changes):
            return Suggestion(name, plan)
    for names, changes in more:
        if len(names) == 1 and (plan := try_(changes)):
            return Suggestion(names[0], plan)
    total: dict = {}
    names: list[str] = []
    for name, changes in ladder:
        total = _merge(total, changes)
        if name == "full recompute":  # replaces the selective step
            names = [n for n in names if not n.startswith("selective")]
        names.append(name)
        if plan := try_(total):
            return Suggestion(" + ".join(names), plan)
    for extra, changes in more:
        if plan := try_(_merge(total, changes)):
            return Suggestion(" + ".join(names + extra), plan)
    return None


def fit_line(plan: Plan, hw: Hardware) -> str:
    if plan.fits:
        return (f"[green]fits[/green]: peak {gib(plan.peak)} GiB of {gib(plan.usable)} GiB usable on a "
                f"{hw.gpu_name}; host {gib(plan.host_per_node)} GiB per node")
    line = (f"[red]does not fit[/red]: peak {gib(plan.peak)} GiB > {gib(plan.usable)} GiB usable on a "
            f"{hw.gpu_name} ({plan.peak_where})")
    s = suggest(plan.run, hw)
    if s is None:
        return line + (f"\nno change along recompute, offload, context parallel up to {MAX_CP_FACTOR}x and "
                       f"pipeline parallel up to {MAX_PP} fits")
    return (line + f"\ncheapest change that fits: [bold]{s.change}[/bold] -> peak {gib(s.plan.peak)} GiB on "
            f"{s.plan.gpus} GPUs, host {gib(s.plan.host_per_node)} GiB per node")


def sweep_table(run: RunConfig, hw: Hardware, lengths=SWEEP_LENGTHS) -> Table:
    table = Table(title=f"{run.model.preset}, {hw.gpu_name}: per-GPU peak over sequence lengths", title_justify="left")
    for col in ("length", "tokens/GPU", "peak GiB", "activations GiB", "where", "host/GPU GiB", "host/node GiB",
                "fits"):
        table.add_column(col, justify="right" if col not in ("where",) else "left")
    for n in lengths:
        plan = estimate(with_changes(run, data={"seq_len": n}), hw)
        acts = next(i.bytes for i in plan.device if i.name.startswith("activations"))
        table.add_row(length_label(n), f"{plan.tokens:,}", gib(plan.peak), gib(acts), plan.peak_where,
                      gib(plan.host_per_gpu), gib(plan.host_per_node),
                      "[green]yes[/green]" if plan.fits else "[red]no[/red]")
    return table


def sweep_time_table(run: RunConfig, hw: Hardware, gpu, constants=None, lengths=SWEEP_LENGTHS) -> Table:
    """The time model over the same lengths: step time, tokens/s, MFU and what bounds the step."""
    from .time_model import CONSTANTS, estimate_time

    table = Table(title=f"{run.model.preset} on {gpu.name}: predicted step time over sequence lengths",
                  title_justify="left")
    for col in ("length", "step s", "tokens/s", "tokens/s per GPU", "MFU", "bound by", "largest part"):
        table.add_column(col, justify="left" if col in ("bound by", "largest part") else "right")
    for n in lengths:
        t = estimate_time(with_changes(run, data={"seq_len": n}), hw, gpu, constants or CONSTANTS)
        top = max(t.items, key=lambda i: i.seconds)
        table.add_row(length_label(n), f"{t.step_seconds:,.1f}", f"{t.tokens_per_s:,.0f}",
                      f"{t.tokens_per_s_per_gpu:,.0f}", f"{t.mfu:.1%}", next(iter(t.by("resource"))),
                      f"{top.name} ({top.seconds / t.step_seconds:.0%})")
    return table


def published_table(hw: Hardware) -> Table:
    from .published import UNITS, compare

    table = Table(title="GLM-5.3-Flash on 64 x B200: published figures next to the plan of the shipped configs",
                  title_justify="left")
    for col in ("figure", "shipped config (changes)", "published", "plan", "plan / published", "source"):
        table.add_column(col, justify="right" if col in ("published", "plan", "plan / published") else "left")
    for fig, planned in compare(hw):
        unit = UNITS[fig.unit]
        ratio = planned / fig.value
        changes = ", ".join(f"{k}={v}" for sec in fig.changes.values() for k, v in sec.items())
        table.add_row(fig.figure, fig.config + (f" ({changes})" if changes else ""),
                      f"{fig.value / unit:,.1f} {fig.unit}", f"{planned / unit:,.1f} {fig.unit}",
                      f"[{'green' if 0.8 <= ratio <= 1.2 else 'yellow'}]x{ratio:.2f}[/]", fig.source)
    return table


def print_plan(plan: Plan, hw: Hardware, console: Console | None = None) -> None:
    console = console or Console()
    console.print(budget_table(plan))
    console.print(fit_line(plan, hw))


# ------------------------------------------------------------------------------------ time
def time_table(timing, label: str = "", published: tuple[str, object] | None = None) -> Table:
    """Step time, throughput and MFU, and the step split by layer type and by resource, of
    ``label`` (the config, in words); ``published``: (the published run's setting in words, its
    timing), for a config the published run ran otherwise."""
    run = timing.run
    of = f" of {label}" if label else ""
    table = Table(title=f"Step time{of} on {timing.gpus} x {timing.gpu.name} (predicted; plan.time_model, "
                        "docs/plan.md)", title_justify="left")
    table.add_column("per step", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note")
    step = timing.step_seconds
    table.add_row("step time", f"{step:,.1f} s", f"{run.train.global_batch_size} x {length_label(run.data.seq_len)} "
                  f"tokens, {timing.tokens_per_step:,} per step")
    table.add_row("tokens/s", f"{timing.tokens_per_s:,.0f}",
                  f"whole cluster; {timing.tokens_per_s_per_gpu:,.0f} per GPU")
    table.add_row("TFLOP/s per GPU", f"{timing.tflops_per_gpu:,.1f}", "model FLOPs (forward + backward, no recompute)")
    table.add_row("MFU", f"{timing.mfu:.1%}", f"of {timing.gpu.bf16_flops / 1e12:,.0f} TFLOP/s bf16 dense")
    table.add_row("bottleneck", "", timing.bottleneck, style="bold yellow")
    table.add_section()
    for resource, seconds in timing.by("resource").items():
        table.add_row(f"[italic]{resource}[/italic]", f"{seconds:,.1f} s", f"{seconds / step:.0%}")
    table.add_section()
    for layer, seconds in timing.by("layer").items():
        table.add_row(f"[italic]{layer}[/italic]", f"{seconds:,.1f} s", f"{seconds / step:.0%}")
    table.add_section()
    for item in sorted(timing.items, key=lambda i: -i.seconds):
        if item.seconds >= 0.005 * step:
            table.add_row(item.name, f"{item.seconds:,.2f} s", f"{item.resource}, {item.seconds / step:.1%}")
    if timing.hidden:
        table.add_section()
        for item in timing.hidden:  # overlapped: not in the step time above
            table.add_row(f"[dim]hidden: {item.name}[/dim]", f"[dim]{item.seconds:,.2f} s[/dim]",
                          "[dim]overlapped, not in the step time[/dim]")
    if published is not None:  # the published figures are of another setting than the table's
        setting, other = published
        table.add_section()
        table.add_row("the published run's setting", f"{other.tokens_per_s:,.0f}",
                      f"tokens/s predicted for {setting}, as the published run ran it (genome-lm plan "
                      "--published)", style="italic")
    return table


def time_plot(timing, path) -> None:
    """A horizontal bar chart of the step's parts, coloured by resource."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # the parts of at least 0.1% of the step, the largest on top
    items = sorted((i for i in timing.items if i.seconds >= 1e-3 * timing.step_seconds), key=lambda i: i.seconds)
    colours = {"compute": "tab:blue", "memory": "tab:green", "communication": "tab:orange", "host": "tab:red",
               "idle": "tab:gray"}
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(items) + 1.5))
    ax.barh([i.name for i in items], [i.seconds for i in items], color=[colours[i.resource] for i in items])
    ax.legend(handles=[Patch(color=colour, label=resource) for resource, colour in colours.items()
                       if any(i.resource == resource for i in items)], loc="lower right")
    ax.set_xlabel("seconds per step (busiest GPU)")
    run = timing.run
    ax.set_title(f"{run.model.preset}, {length_label(run.data.seq_len)} on {timing.gpus} x {timing.gpu.name}: "
                 f"{timing.step_seconds:,.0f} s, {timing.tokens_per_s:,.0f} tokens/s, MFU {timing.mfu:.1%}", fontsize=9)
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")  # no half-written chart under the name asked for
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def published_time_table(hw: Hardware, constants=None) -> Table:
    from .published import compare_time, predicted_time

    table = Table(title="GLM-5.3-Flash on 64 x B200: published throughput next to the time model", title_justify="left")
    numbers = ("published", "predicted", "predicted / published", "the shipped config, predicted")
    for col in ("figure", "the published run's setting (changes)", *numbers, "role"):
        table.add_column(col, justify="right" if col in numbers else "left")
    for fig, value in compare_time(hw, constants):
        changes = ", ".join(f"{k}={v}" for sec in fig.run_changes().values() for k, v in sec.items())
        shipped = predicted_time(fig, hw, constants, shipped=True)
        if fig.unit == "%":
            cells = (f"+{fig.value:.0%}", f"{value:+.1%}", f"{(value - fig.value) * 100:+.1f} points",
                     f"{shipped:+.1%}")
        else:
            cells = (f"{fig.value:,.0f} tokens/s", f"{value:,.0f} tokens/s", f"x{value / fig.value:.2f}",
                     f"{shipped:,.0f} tokens/s")
        table.add_row(fig.figure, fig.config + (f" ({changes})" if changes else ""), *cells,
                      "fitted (kernel efficiency)" if fig.fitted else "predicted")
    return table
