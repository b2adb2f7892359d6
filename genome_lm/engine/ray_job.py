"""Start a job over many processes with Ray: one actor per GPU (or per CPU worker on a machine
without GPUs), placed by a placement group, joined into one torch.distributed job.

The driver reserves ``workers`` bundles (``{"GPU": 1, "CPU": cpus_per_worker}`` or
``{"CPU": cpus_per_worker}``), starts an actor in each, hands every actor its rank and the
address of rank 0's TCP rendezvous, and has each run one function (named as ``module:function``,
imported in the actor: training's ``train.launch.train_rank``, evaluation's
``eval.evaluate.evaluate_rank``) exactly as a torchrun rank would. The driver returns rank 0's
result; a GenomeLMError raised on a rank is raised again here. For one node without Ray, torchrun
does the same job.
"""

from __future__ import annotations

import importlib
import os
import socket

from genome_lm.errors import GenomeLMError

from .backend import on_gpu


class _Worker:
    """One rank of the job (a Ray actor)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def address(self) -> tuple[str, int]:
        from .parallel import free_port

        return socket.gethostbyname(socket.gethostname()), free_port()

    def run(self, target: str, payload, rendezvous: str, threads: int):
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        import torch

        from .parallel import init_distributed

        if on_gpu():
            os.environ["LOCAL_RANK"] = "0"  # Ray gives each actor exactly one visible GPU
        torch.set_num_threads(max(1, threads))
        init_distributed(self.rank, self.world_size, init_method=rendezvous)
        module, _, function = target.partition(":")
        return getattr(importlib.import_module(module), function)(payload, self.rank)


def run_on_ray(target: str, payload, *, address: str, workers: int, cpus_per_worker: int = 1,
               gpus: bool | None = None):
    """Call ``target(payload, rank)`` (``"module:function"``) on ``workers`` Ray actors joined into
    one process group; returns rank 0's result."""
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
        futures = [r.run.remote(target, payload, f"tcp://{host}:{port}", cpus_per_worker) for r in ranks]
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
