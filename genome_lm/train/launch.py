"""Start a training job on a Ray cluster (``engine.ray_job``: one actor per GPU, joined into one
torch.distributed job):

    genome-lm finetune --config glm-5.3-flash-512k-64xb200 --ray-address auto --workers 64

Each actor runs ``train.trainer.train`` exactly as a torchrun rank would; rank 0 draws the
progress bar and logs to MLflow, the others are quiet. The driver returns rank 0's result.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from genome_lm.engine.ray_job import run_on_ray
from genome_lm.model.presets import model_config

if TYPE_CHECKING:
    from genome_lm.config import RunConfig


def check_layout(cfg: RunConfig, world_size: int) -> None:
    """The parallel layout's one-line errors for ``world_size`` ranks, raised here instead of on
    every rank once the workers are placed: the sizes against the world, the config's stated GPU
    count against it, and the pipeline split of the model's layers (``model.model.pipeline_split``,
    as the ranks will build it)."""
    from genome_lm.engine.parallel import ParallelSizes, check_stated_gpus
    from genome_lm.model.model import pipeline_stages

    ParallelSizes.of(cfg.parallel).check(world_size)
    check_stated_gpus(cfg.parallel.gpus, world_size)
    pipeline_stages(model_config(cfg), cfg)


def train_on_ray(cfg: RunConfig, *, address: str, workers: int, cpus_per_worker: int = 1, gpus: bool | None = None,
                 resume: bool = False, tracking_uri: str | None = None, progress: bool = True,
                 max_steps: int | None = None, resume_from: str | None = None, overwrite: bool = False):
    """Run ``train(cfg)`` on ``workers`` Ray actors; returns rank 0's ``TrainResult``."""
    from genome_lm.checkpoint import check_run_folder

    check_layout(cfg, workers)  # before a cluster is asked for anything
    check_run_folder(Path(cfg.train.out_dir), resume=resume, resume_from=resume_from, overwrite=overwrite)
    # actors do not share the driver's working folder: hand them absolute paths (on a multi-node
    # cluster these must be on storage every node sees)
    data = cfg.data.model_copy(update={"dataset": os.path.abspath(cfg.data.dataset)})
    train_section = cfg.train.model_copy(update={"out_dir": os.path.abspath(cfg.train.out_dir)})
    cfg = cfg.model_copy(update={"data": data, "train": train_section})
    options = {"resume": resume, "tracking_uri": tracking_uri, "max_steps": max_steps, "progress": progress,
               "overwrite": overwrite, "resume_from": None if resume_from is None else os.path.abspath(resume_from)}

    return run_on_ray("genome_lm.train.launch:train_rank", (cfg.resolved(), options), address=address,
                      workers=workers, cpus_per_worker=cpus_per_worker, gpus=gpus)


def train_rank(payload, rank: int):
    """One Ray rank of ``train_on_ray``: ``train`` with the driver's config; rank 0's result."""
    from genome_lm.config import RunConfig

    from .trainer import train

    config_json, options = payload
    cfg = RunConfig.model_validate(config_json, strict=False)
    result = train(cfg, progress=options.pop("progress", True) and rank == 0, **options)
    return result if rank == 0 else None
