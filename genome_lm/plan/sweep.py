"""``genome-lm bench sweep``: tokens/s and peak memory of one tiny-model training step on this CPU
per sequence length and memory setting, measured next to the planner's prediction, as a table,
JSON and a PNG (two panels: tokens/s and peak memory against length, one line per setting).

Time: the step's FLOPs (``model.flops``, recompute included) at this CPU's measured matrix-product
rate (``engine.devices.measured_matmul_flops``, with the step's threads) are the time a step would take
if all its arithmetic ran at that rate, the CPU's roofline for compute; measured / predicted is
how far the step is from it (on a CPU the elementwise work, which the FLOP count leaves out,
takes most of the step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from genome_lm.config import load_config
from genome_lm.engine.devices import measured_matmul_flops
from genome_lm.model import flops

from .measure import measure_step
from .memory_model import Hardware, estimate, model_config, with_changes

if TYPE_CHECKING:
    from genome_lm.config import RunConfig

SETTINGS: dict[str, dict] = {
    "plain": {},
    "selective": {"recompute": "selective", "recompute_modules": ["attention"]},
    "recompute": {"recompute": "full"},
    "nested": {"recompute": "full", "recompute_nested": True},
    "moe-chunks": {"moe_chunks": 4},
    # offload moves nothing off a device on a CPU: what it shows here is the cost of its copies
    "offload": {"offload_activations": True},
    "recompute+offload": {"recompute": "full", "offload_activations": True, "moe_chunks": 8},
}


def predicted_step(run: RunConfig) -> float:
    """Bytes a step adds to the built model on a CPU: gradients and the activation peak."""
    plan = estimate(run, Hardware(device="cpu"))
    return sum(i.bytes for i in plan.device if i.name.startswith(("gradients", "activations")))


def step_flops(run: RunConfig) -> float:
    """FLOPs of one step of ``run`` on the CPU path (matrix products and gathered attention),
    recompute included."""
    work = flops.step_work(model_config(run), run.memory, T=run.data.seq_len, batch=run.train.micro_batch_size,
                           indexer_loss_mode=run.train.indexer_loss)
    return flops.total(work)


def cpu_matmul_rate(threads: int) -> float:
    """This CPU's matrix-product FLOP/s with ``threads`` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measured_matmul_flops()
    finally:
        torch.set_num_threads(before)


def run_sweep(settings: list[str], lengths: list[int], threads: int, out: Path, progress=None) -> list[dict]:
    base = load_config("demo-cpu", ["train.global_batch_size=1"])
    rate = cpu_matmul_rate(threads)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in settings:
        for T in lengths:
            run = with_changes(base, data={"seq_len": T}, memory=SETTINGS[name])
            got = measure_step(run, threads=threads, timeout=3600)
            work = step_flops(run)
            row = {"setting": name, "seq_len": T, "seconds": got.seconds, "tokens_per_s": got.tokens_per_s,
                   "peak_bytes": got.peak_bytes, "predicted_bytes": predicted_step(run), "flops": work,
                   "matmul_flops_per_s": rate, "predicted_seconds": work / rate}
            rows.append(row)
            if progress is not None:
                progress.print(f"{name:>10} {T:>8,}: {row['tokens_per_s']:8,.0f} tok/s "
                               f"(FLOP-bound {T / row['predicted_seconds']:,.0f}), peak "
                               f"{got.peak_bytes / 2**20:8,.0f} MiB (plan {row['predicted_bytes'] / 2**20:,.0f})",
                               highlight=False)
            (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    return rows


def sweep_rows_table(rows: list[dict]) -> Table:
    table = Table(title="tiny model, one forward+backward step on this CPU", title_justify="left")
    for col in ("setting", "length", "seconds", "predicted s (FLOP-bound)", "measured / predicted", "tokens/s",
                "peak MiB", "plan MiB", "plan / measured"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for r in rows:
        table.add_row(r["setting"], f"{r['seq_len']:,}", f"{r['seconds']:.1f}", f"{r['predicted_seconds']:.2f}",
                      f"x{r['seconds'] / r['predicted_seconds']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['peak_bytes'] / 2**20:,.0f}", f"{r['predicted_bytes'] / 2**20:,.0f}",
                      f"x{r['predicted_bytes'] / r['peak_bytes']:.2f}")
    return table


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, name in enumerate(dict.fromkeys(r["setting"] for r in rows)):
        mine = [r for r in rows if r["setting"] == name]
        x = [r["seq_len"] for r in mine]
        color = f"C{i}"
        ax1.plot(x, [r["tokens_per_s"] for r in mine], marker="o", color=color, label=name)
        if all("predicted_seconds" in r for r in mine):
            ax1.plot(x, [r["seq_len"] / r["predicted_seconds"] for r in mine], ls="--", color=color,
                     label=f"{name} (FLOP-bound)")
        ax2.plot(x, [r["peak_bytes"] / 2**20 for r in mine], marker="o", color=color, label=f"{name} (measured)")
        ax2.plot(x, [r["predicted_bytes"] / 2**20 for r in mine], ls="--", color=color, label=f"{name} (plan)")
    ax1.set_yscale("log")
    for ax, label in ((ax1, "tokens/s"), (ax2, "peak memory of the step (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8, loc="upper left" if ax is ax2 else "best")
    ax2.set_yscale("log", base=2)
    fig.suptitle("tiny GLM-5.3-Flash, one training step on this CPU: memory settings")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
