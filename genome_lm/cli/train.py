"""Training commands: ``finetune`` and ``export``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from genome_lm.engine import quiet_megatron_import
from genome_lm.engine.backend import on_gpu
from genome_lm.errors import signal_exit_code
from genome_lm.train.launch import train_on_ray

from .base import app, console


@app.command()
def finetune(
    config: Annotated[str, typer.Option(help="A config name from configs/ (demo-cpu, glm-5.3-flash-512k-64xb200, ...) "
                                             "or a YAML path.")] = "demo-cpu",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: --set train.steps=20 "
                                                                    "(repeatable).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the run folder's latest checkpoint.")] = False,
    resume_from: Annotated[Optional[str], typer.Option(help="Continue from this checkpoint (a folder, or its name such "
                                                            "as step-000020) instead of the latest.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Start a new run in a folder that already holds one, deleting its "
                                                 "checkpoints (without it, that is refused).")] = False,
    tracking_uri: Annotated[Optional[str], typer.Option(help="MLflow server (http://host:5000); default: a SQLite "
                                                             "store in the run folder (also used when the server "
                                                             "cannot be reached).")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    ray_address: Annotated[Optional[str], typer.Option(help="Train on a Ray cluster ('auto', host:port, or 'local' to "
                                                            "start one here).")] = None,
    workers: Annotated[int, typer.Option(help="With --ray-address: ranks to start (one GPU each, or CPU workers "
                                              "without GPUs).", min=1)] = 1,
    cpus_per_worker: Annotated[int, typer.Option(help="With --ray-address: CPUs reserved per rank.", min=1)] = 1,
) -> None:
    """Fine-tune the model on a prepared dataset (megatron-core; tracked in MLflow).

    One process trains on this machine. For a node of GPUs start it with torchrun
    (`torchrun --nproc-per-node 8 -m genome_lm finetune --config ...`): every rank runs this
    command and the sizes in `parallel:` split the model. On a Ray cluster use --ray-address and
    --workers: one actor per GPU in a placement group, rank 0 reports. Checkpoints go to train.out_dir every
    train.save_every steps, at the end and on SIGTERM/Ctrl-C; --resume continues from the last."""
    from genome_lm.config import load_config

    cfg = load_config(config, set_ or [])

    if not on_gpu():  # memory.host_heap: auto -> keep or return, from the plan (engine.allocator)
        from genome_lm.plan.memory_model import host_heap

        ranks = workers if ray_address is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cfg = host_heap(cfg, ranks)
    with quiet_megatron_import():
        if ray_address is not None:
            result = train_on_ray(cfg, address=ray_address, workers=workers, cpus_per_worker=cpus_per_worker,
                                  resume=resume, tracking_uri=tracking_uri, progress=not quiet,
                                  resume_from=resume_from, overwrite=overwrite)
        else:
            from genome_lm.train.trainer import train

            result = train(cfg, resume=resume, progress=not quiet, tracking_uri=tracking_uri,
                           resume_from=resume_from, overwrite=overwrite)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 reports
        print_training(result)
    if (code := signal_exit_code(result.stopped_by)) is not None:  # checkpointed; the shell still sees why
        raise typer.Exit(code)


SMOOTH_STEPS = 10  # the summary's loss: the mean over this many steps at each end (a quarter of a short run)


def loss_ends(steps) -> tuple[tuple[float, int, int], tuple[float, int, int]]:
    """(mean LM loss, first step, last step) over the first and the last n steps, n = min(10,
    a quarter of the run, at least 1): each step's loss is one batch's, which swing by several
    percent from batch to batch, so single steps at the two ends can point the wrong way."""
    n = max(1, min(SMOOTH_STEPS, len(steps) // 4))

    def mean(part):
        return sum(m.lm_loss for m in part) / len(part), part[0].step, part[-1].step

    return mean(steps[:n]), mean(steps[-n:])


def print_training(result, to_continue: str = "continue with --resume") -> None:
    """The run's summary: where it resumed from, the loss at its start and end (means over a few
    steps), speed, the checkpoint, MLflow; ``to_continue``: how to continue a run a signal
    stopped, in the words of the command that ran it."""
    steps = result.all_steps
    if result.resumed_from is not None:
        console.print(f"resumed from step {result.resumed_from.name.split('-')[-1].lstrip('0') or '0'} "
                      f"({result.resumed_from})", highlight=False)
    if not steps:
        console.print("no steps run")
    else:
        _print_losses(result, steps)
    if result.stopped_by:
        console.print(f"stopped by {result.stopped_by}; {to_continue}", highlight=False)
    if result.checkpoint is not None:
        console.print(f"checkpoint: {result.checkpoint}", highlight=False)
    if result.loss_curve is not None:
        console.print(f"loss curve: {result.loss_curve}", highlight=False)
    if result.tracking:
        console.print(f"MLflow: {result.tracking}", highlight=False)


def _print_losses(result, steps) -> None:
    """The table of the run's loss at its start and end, its speed and peak memory."""
    if not result.history:
        console.print(f"the run was already complete at step {result.steps_done}")
    (first, a0, a1), (last, b0, b1) = loss_ends(steps)
    table = Table(title=f"fine-tuning in {result.out_dir}", title_justify="left",
                  caption=None if a0 == a1 else "loss: the mean training LM loss over the steps in brackets "
                                                 "(one batch a step; eval reports held-out loss)")
    for column in ("steps", "first loss (steps)", "last loss (steps)", "change", "tokens/s", "peak host MiB"):
        table.add_column(column, justify="right")

    def span(x, y):
        return f"{x}" if x == y else f"{x}-{y}"

    change = (last - first) / first * 100
    table.add_row(f"{result.steps_done}", f"{first:.4f} ({span(a0, a1)})", f"{last:.4f} ({span(b0, b1)})",
                  f"{change:+.1f}%", f"{steps[-1].tokens_per_s:,.0f}", f"{steps[-1].peak_host_mib:,.0f}")
    console.print(table)


@app.command()
def export(
    run: Annotated[Path, typer.Option(help="A training run folder (train.out_dir).")],
    out: Annotated[Path, typer.Option(help="Folder for the Hugging Face glm5_next safetensors.")],
    checkpoint: Annotated[Optional[str], typer.Option(help="Checkpoint folder name (default: the latest).")] = None,
    like: Annotated[Optional[Path], typer.Option(help="A Hugging Face checkpoint whose config.json and tensor dtypes "
                                                      "to copy.")] = None,
    adapters: Annotated[bool, typer.Option("--adapters", help="A LoRA run (peft.method=lora): write its adapters "
                                           "alone in the Hugging Face PEFT layout (adapter_config.json + "
                                           "adapter_model.safetensors, which peft loads onto transformers' "
                                           "glm5_next base) instead of the merged model.")] = False,
) -> None:
    """Write a training checkpoint as Hugging Face glm5_next safetensors (sharded, with an index); a
    LoRA run's adapters are folded into the weights, or written alone with --adapters."""
    from genome_lm.train.export import export_run

    with quiet_megatron_import():
        path = export_run(run, out, checkpoint=checkpoint, like=like, adapters=adapters)
    console.print(f"wrote {path}", highlight=False)
