"""Start a training job over many processes with Ray: one actor per GPU (or per CPU worker on a
machine without GPUs), placed by a placement group, joined into one torch.distributed job.

    genome-lm finetune --config glm-5.3-flash-512k-64xb200 --ray-address auto --workers 64

The driver reserves ``workers`` bundles (``{"GPU": 1, "CPU": cpus_per_worker}`` or
``{"CPU": cpus_per_worker}``), starts an actor in each, hands every actor its rank and the
address of rank 0's TCP rendezvous, and waits. Each actor runs ``train.trainer.train`` exactly as
a torchrun rank would; rank 0 draws the progress bar and logs to MLflow, the others are quiet.
The driver returns rank 0's result. For one node without Ray, torchrun does the same job.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from genome_lm.engine.backend import on_gpu
from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.config import RunConfig


class _Worker:
    """One rank of the job (a Ray actor)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def address(self) -> tuple[str, int]:
        from genome_lm.engine.parallel import free_port

        return socket.gethostbyname(socket.gethostname()), free_port()

    def _join(self, rendezvous: str, threads: int) -> None:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        import torch

        from genome_lm.engine.parallel import init_distributed

        if on_gpu():
            os.environ["LOCAL_RANK"] = "0"  # Ray gives each actor exactly one visible GPU
        torch.set_num_threads(max(1, threads))
        init_distributed(self.rank, self.world_size, init_method=rendezvous)

    def train(self, config_json: dict, rendezvous: str, options: dict):
        from genome_lm.config import RunConfig
        from .trainer import train

        self._join(rendezvous, options.pop("threads", 1))
        cfg = RunConfig.model_validate(config_json, strict=False)
        result = train(cfg, progress=options.pop("progress", True) and self.rank == 0, **options)
        return result if self.rank == 0 else None

    def evaluate(self, request, rendezvous: str, options: dict):
        from genome_lm.eval.evaluate import evaluate

        self._join(rendezvous, options.pop("threads", 1))
        return evaluate(request, progress=options.get("progress", True) and self.rank == 0)


def check_layout(cfg: RunConfig, world_size: int) -> None:
    """The parallel layout's one-line errors for ``world_size`` ranks, raised here instead of on
    every rank once the workers are placed: the sizes against the world, and the pipeline split
    of the model's layers (``model.model.pipeline_split``, as the ranks will build it)."""
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import pipeline_stages
    from genome_lm.model.presets import model_config

    ParallelSizes.of(cfg.parallel).check(world_size)
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
               "threads": cpus_per_worker, "overwrite": overwrite,
               "resume_from": None if resume_from is None else os.path.abspath(resume_from)}
    return _on_ray("train", cfg.resolved(), options, address=address, workers=workers,
                   cpus_per_worker=cpus_per_worker, gpus=gpus)


def eval_on_ray(request, *, address: str, workers: int, cpus_per_worker: int = 1, gpus: bool | None = None,
                progress: bool = True):
    """Run ``eval.evaluate.evaluate(request)`` on ``workers`` Ray actors (the model split by the
    request's layout, the windows shared out); returns rank 0's report."""
    import dataclasses

    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.eval.evaluate import eval_layout
    from genome_lm.eval.parallel import check_sizes

    sizes = eval_layout(request, workers)
    sizes.check(workers)  # before a cluster is asked for anything
    check_sizes(sizes)
    absolute = {f: (None if getattr(request, f) is None else Path(os.path.abspath(getattr(request, f))))
                for f in ("out", "dataset", "fasta", "planted")}
    model = request.model if ":" in str(request.model) or str(request.model) == "init" else os.path.abspath(request.model)
    baseline = request.baseline
    if baseline is not None and ":" not in baseline and baseline != "init":
        baseline = os.path.abspath(baseline)
    request = dataclasses.replace(request, model=model, baseline=baseline, layout=vars(ParallelSizes(**vars(sizes))),
                                  **absolute)
    options = {"threads": cpus_per_worker, "progress": progress}
    return _on_ray("evaluate", request, options, address=address, workers=workers, cpus_per_worker=cpus_per_worker,
                   gpus=gpus)


def _on_ray(method: str, payload, options: dict, *, address: str, workers: int, cpus_per_worker: int,
            gpus: bool | None):
    """Start ``workers`` actors in a placement group, call ``_Worker.<method>(payload, rendezvous,
    options)`` on each, and return rank 0's result; a GenomeLMError on a rank is raised here."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 configure_logging=False, log_to_driver=True)
    try:
        use_gpus = gpus if gpus is not None else ray.cluster_resources().get("GPU", 0) >= workers
        bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpus else {})}
        group = placement_group([bundle] * workers, strategy="PACK")
        try:
            ray.get(group.ready(), timeout=300)
        except ray.exceptions.GetTimeoutError:
            raise GenomeLMError(f"Ray cluster at {address!r} cannot place {workers} workers of {bundle} "
                                f"(it has {ray.cluster_resources()})") from None
        actor = ray.remote(_Worker)
        ranks = [actor.options(num_cpus=cpus_per_worker, num_gpus=1 if use_gpus else 0,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement_group=group, placement_group_bundle_index=i)).remote(i, workers)
                 for i in range(workers)]
        host, port = ray.get(ranks[0].address.remote())
        futures = [getattr(r, method).remote(payload, f"tcp://{host}:{port}", dict(options)) for r in ranks]
        try:
            results = ray.get(futures)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), GenomeLMError) else None
            if cause is not None:
                raise cause from None
            raise
        finally:
            for r in ranks:
                ray.kill(r)
            remove_placement_group(group)
        return results[0]
    finally:
        if started_here:
            ray.shutdown()
