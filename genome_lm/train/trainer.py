"""The training loop: one function, ``train(config)``, run on every rank.

    process groups (engine.parallel) -> model (model.build_model, HF weights or random)
    -> memory techniques (train.memory) -> megatron-core DDP -> optimizer (train.optim)
    -> for each step: micro-batches from the prepared dataset (data.loader), weighted loss
       normalised by the global batch's weight, forward and backward (``train.step``, the step
       the planner and the benchmarks run too), megatron-core's finalize_model_grads
       (data-parallel reduction, MoE expert-bias update), clip, step, metrics to MLflow (losses,
       tokens/s, and TFLOP/s per GPU and MFU from ``train.throughput``)
    -> checkpoints every N steps, at the end, and on SIGTERM/SIGINT

Loss parts, each a metric: ``lm_loss`` (weighted cross-entropy), ``indexer_loss`` (sum over the
DSA layers), ``moe_aux_loss`` (with ``train.moe_aux_loss_coeff`` > 0: the routers' load-balancing
loss, summed over the MoE layers, averaged over the global batch's micro-batches; absent when the
coefficient is 0, since it is then not computed); ``loss`` = lm + coefficient x each part. The
auxiliary loss reaches the parameters as a gradient only (``model.router``).

Non-finite losses: with ``train.nonfinite = "skip"`` the step's update is skipped and reported,
and three non-finite steps in a row stop the run; with "stop" the first one stops it. Either way
the last good checkpoint is kept. Rank 0 reports each skipped step and the stop once, above the
progress bar or, without one (``--quiet``), as a logging warning on stderr.

Signals: SIGTERM / SIGINT on any rank stop every rank after the same step (the ranks agree on it
at the end of each step), which then checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import resource
import shutil
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from genome_lm.checkpoint import (
    build,
    check_run_folder,
    existing_checkpoints,
    load_checkpoint,
    resume_point,
    save_checkpoint,
    token_map,
)
from genome_lm.checkpoint.sharded import content_digest
from genome_lm.checkpoint.training import base_record
from genome_lm.engine.backend import current, on_gpu
from genome_lm.errors import GenomeLMError
from genome_lm.progress import StepProgress
from genome_lm.tracking import Tracker

from .step import indexer_mode
from .throughput import Throughput

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from genome_lm.config import RunConfig
    from genome_lm.engine.backend import BackendProfile
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import GLM5Model

log = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    step: int
    loss: float
    lm_loss: float
    indexer_loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float
    skipped: bool
    peak_host_mib: float
    peak_device_mib: float
    moe_max_over_mean: float
    moe_aux_loss: float | None = None  # None: train.moe_aux_loss_coeff is 0, the loss is not computed
    tflops_per_gpu: float = 0.0  # model FLOPs of this rank's step (train.throughput) per second, / 1e12
    mfu: float = 0.0  # ... over the device's peak (a GPU's bf16 dense rate; a CPU's measured matmul rate)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {"loss": self.loss, "lm_loss": self.lm_loss, "indexer_loss": self.indexer_loss, "lr": self.lr,
                "grad_norm": self.grad_norm, "tokens_per_s": self.tokens_per_s, "step_seconds": self.seconds,
                "peak_host_mib": self.peak_host_mib, "peak_device_mib": self.peak_device_mib,
                "moe_busiest_expert_over_mean": self.moe_max_over_mean, "skipped": float(self.skipped),
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                **({} if self.moe_aux_loss is None else {"moe_aux_loss": self.moe_aux_loss})}


@dataclass
class TrainResult:
    out_dir: Path
    steps_done: int
    history: list[StepMetrics] = field(default_factory=list)  # the steps this call ran
    checkpoint: Path | None = None
    run_id: str | None = None
    stopped_by: str | None = None
    tracking: str = ""
    resumed_from: Path | None = None  # the checkpoint this call continued from
    loss_curve: Path | None = None  # loss_curve.png in the run folder (rank 0, when matplotlib is there)
    earlier: list[StepMetrics] = field(default_factory=list)  # the run's steps before it (from the checkpoint)

    @property
    def all_steps(self) -> list[StepMetrics]:
        """Every step of the run so far, the ones before a resume included."""
        return self.earlier + self.history


class _StopFlag:
    """SIGTERM / SIGINT ask the loop to checkpoint and stop at the end of the current step
    (``agreed``: every rank stops after the same step)."""

    def __init__(self):
        self.signal: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a Ray actor): leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self) -> str | None:
        """The signal that stops the run after this step, agreed by all ranks: a rank that got
        none stops too when another did (the highest signal number names it). One all-reduce of
        one number over all ranks; call at the same point of every step on every rank."""
        number = signal.Signals[self.signal].value if self.signal is not None else 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([float(number)], device=_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            number = int(flag.item())
        return signal.Signals(number).name if number else None


def _peak_host_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _moe_load(model: GLM5Model, group=None, pp_group=None) -> float:
    """Busiest expert's token count over the mean, across MoE layers, for the tokens of the whole
    step: megatron-core's router keeps ``local_tokens_per_expert`` (this rank's tokens) for the
    expert-bias update; the counts are summed over ``group`` (tensor, data and context parallel
    ranks) first. Ranks that route the same tokens (tensor parallel without sequence parallel)
    add the same counts, which leaves the ratio unchanged. Under pipeline parallel each stage
    has its own MoE layers: the largest ratio over the stages (``pp_group``)."""
    from .loss import global_sum

    counts = [buf for name, buf in model.named_buffers() if name.endswith("local_tokens_per_expert")]
    worst = 0.0
    if counts:
        for row in global_sum(torch.stack([c.float() for c in counts]), group):
            if row.sum() > 0:
                worst = max(worst, float(row.max() / row.mean()))
    if pp_group is not None and pp_group.size() > 1:
        value = torch.tensor(worst, device=_device())  # NCCL reduces GPU tensors only
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=pp_group)
        worst = float(value)
    return worst


def seq_len_at(cfg: RunConfig, step: int) -> int:
    """The training crop at ``step``: ``data.seq_len``, or its warm-up value."""
    length = cfg.data.seq_len
    for start, value in sorted(cfg.data.seq_len_warmup):
        if step >= start:
            length = value
    return length


def default_run_name(cfg: RunConfig) -> str:
    """The MLflow run's name: the config's, the preset and the run folder (``demo-cpu: tiny (runs/demo-cpu)``)."""
    source = getattr(cfg, "source", None)
    name = Path(source).stem if source else Path(cfg.train.out_dir).name
    return f"{name}: {cfg.model.preset} ({cfg.train.out_dir})"


class Trainer:
    """One rank's training: ``__init__`` builds the parts (model, megatron-core DDP, optimizer,
    data loader) in the run's process groups, ``step`` runs one optimizer step, ``save`` and
    ``restore`` write and read its checkpoints. ``train`` drives it."""

    def __init__(self, cfg: RunConfig, pg: ProcessGroupCollection, sizes: ParallelSizes, backend: BackendProfile):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from genome_lm.data.loader import TrainLoader
        from genome_lm.model.router import set_aux_loss_grad_scale

        from .memory import apply_memory
        from .optim import make_optimizer

        self.cfg, self.pg, self.sizes = cfg, pg, sizes
        self.dp_size = pg.dp.size()
        if cfg.train.global_batch_size % (self.dp_size * cfg.train.micro_batch_size):
            raise GenomeLMError(f"global_batch_size {cfg.train.global_batch_size} is not a multiple of "
                                f"micro_batch_size x data-parallel size ({cfg.train.micro_batch_size} x "
                                f"{self.dp_size})")
        self.n_micro = cfg.train.global_batch_size // self.dp_size // cfg.train.micro_batch_size
        torch.manual_seed(cfg.train.seed)
        self.model = model = build(cfg, pg, sizes)
        # each micro-batch's auxiliary loss counts 1 / (micro-batches of the global batch); the
        # data- and context-parallel gradient reduction sums (calculate_per_token_loss below)
        set_aux_loss_grad_scale(model, 1.0 / (self.dp_size * self.n_micro))
        apply_memory(model, cfg.memory)
        model.tf_config.calculate_per_token_loss = True  # the loss is already normalised globally: sum grads
        self.ddp = DistributedDataParallel(
            model.tf_config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                           overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                                                           use_distributed_optimizer=backend.distributed_optimizer),
            model, pg_collection=pg)
        self.optimizer = make_optimizer(cfg, self.ddp, pg, backend)
        self.to_model = token_map(cfg, model)

        self.throughput = Throughput(cfg, model.cfg, micro_batches=self.n_micro,
                                     ranks=pg.tp.size() * pg.cp.size() * pg.pp.size(), gpu=backend.gpu)
        self.loader = TrainLoader(cfg.data.dataset, cfg.data.train_split, seq_len=seq_len_at(cfg, 0),
                                  micro_batch_size=cfg.train.micro_batch_size, softmask_weight=cfg.data.softmask_weight,
                                  reverse_complement=cfg.data.reverse_complement,
                                  max_n_fraction=cfg.data.max_n_fraction, seed=cfg.train.seed,
                                  rank=pg.dp.rank(), world_size=self.dp_size,
                                  mix=[(m.dataset, m.split, m.fraction) for m in cfg.data.mix])

    def restore(self, folder: Path) -> dict:
        """Load a checkpoint into the model, optimizer and loader; returns its state."""
        state = load_checkpoint(folder, self.model, self.optimizer, layout=vars(self.sizes))
        self.loader.load_state_dict(state["loader"])
        return state

    def save(self, out: Path, step: int, run_id: str | None, history: list[StepMetrics]) -> Path:
        meta = {"config": self.cfg.resolved(), "config_source": self.cfg.source, "layout": vars(self.sizes),
                "model_config": self.model.cfg.to_hf()}
        if (base := base_record(self.model)) is not None:  # an adapter checkpoint names its base
            if content_digest(self.model) != base["digest"]:
                raise GenomeLMError("the frozen base changed during training (its digest differs from the one taken "
                                    "when it was loaded): a bug; no checkpoint written")
            meta["base"] = base
        state = {"step": step, "loader": self.loader.state_dict(), "run_id": run_id,
                 "history": [dataclasses.asdict(m) for m in history]}
        return save_checkpoint(out, step, self.model, self.optimizer, state, meta)

    def step(self, step: int) -> StepMetrics:
        """Optimizer step ``step`` (0-based): forward and backward over the micro-batches, the
        gradient reductions, the update (skipped on a non-finite loss or gradient) and its metrics."""
        from megatron.core.distributed import finalize_model_grads

        from genome_lm.model.router import take_aux_loss

        from .loss import global_sum
        from .memory import release_host_cache
        from .optim import allreduce_sequence_parallel_grads, learning_rate

        cfg, pg, t0 = self.cfg, self.pg, time.perf_counter()
        seq_len = seq_len_at(cfg, step)
        self.loader.set_seq_len(seq_len)
        lr = learning_rate(step, cfg.train)
        self.optimizer.set_lr(lr)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro, positions = self._micro_batches()
        weight = global_sum(sum(b.loss_weight.sum() for b in micro), pg.dp_cp)
        lm_sum, idx_sum = self._forward_backward(micro, step, weight, positions)
        release_host_cache()
        moe_load = _moe_load(self.model, pg.tp_dp_cp, pg.pp)  # read before finalize_model_grads resets the counts
        if cfg.parallel.overlap_grad_reduce:  # wait for the buckets in flight before touching their gradients
            self.ddp.finish_grad_sync()
        allreduce_sequence_parallel_grads(self.model)
        finalize_model_grads([self.ddp], pg_collection=pg)
        lm = float(global_sum(lm_sum, pg.dp_cp) / weight)
        idx = float(global_sum(idx_sum, pg.dp_cp)) / self.dp_size
        coeff = cfg.train.moe_aux_loss_coeff
        aux = take_aux_loss(self.model)  # this rank's share: TP/CP ranks and pipeline stages hold parts
        moe_aux = float(global_sum(aux, None)) / (self.dp_size * self.n_micro) if coeff > 0 else None  # all ranks
        stepped, norm = self.optimizer.step() if math.isfinite(lm) else (False, float("nan"))
        tokens = sum(int(b.tokens.numel()) for b in micro)
        tokens_all = int(global_sum(torch.tensor(float(tokens)), pg.dp_cp))  # TP ranks share their tokens
        total = lm + cfg.train.indexer_loss_coeff * idx + (coeff * moe_aux if moe_aux else 0.0)
        seconds = time.perf_counter() - t0
        tflops, mfu = self.throughput.metrics(seq_len, indexer_mode(cfg, step), seconds)
        return StepMetrics(step + 1, total, lm, idx, lr, norm, tokens_all, seconds, not stepped,
                           _peak_host_mib(), _peak_device_mib(), moe_load, moe_aux, tflops, mfu)

    def _micro_batches(self) -> tuple[list, int]:
        """The step's micro-batches and their whole length (positions before context-parallel
        padding): every context-parallel rank of a data-parallel rank reads the same batches
        and keeps its zigzag part; bases become the checkpoint's tokens."""
        cp, cp_rank = self.pg.cp.size(), self.pg.cp.rank()
        whole = [self.loader.next_batch() for _ in range(self.n_micro)]
        micro = [_cp_part(batch, cp, cp_rank) for batch in whole]
        if self.to_model is not None:  # bases -> the checkpoint's single-letter tokens
            for batch in micro:
                batch.tokens = self.to_model[batch.tokens]
                batch.labels = self.to_model[batch.labels.clamp_min(0)]
        return micro, whole[0].tokens.shape[1]

    def _forward_backward(self, micro: list, step: int, weight, positions: int):
        """Forward and backward of every micro-batch (``train.step``; the 1F1B schedule under
        pipeline parallel); returns this rank's sums of the weighted LM loss and of the indexer
        loss, each over the pipeline's stages. ``positions``: the batches' length before
        context-parallel padding, which the indexer loss stops at."""
        from .loss import global_sum
        from .step import forward_backward, step_spec

        cfg, pg = self.cfg, self.pg
        # indexer_tokens: the model already divides each CP rank's indexer loss by cp
        spec = step_spec(cfg, global_weight=weight, step=step, micro_batches=len(micro), data_parallel=self.dp_size,
                         tp_group=pg.tp, indexer_tokens=positions if pg.cp.size() > 1 else None,
                         no_sync=self.ddp.no_sync if cfg.parallel.overlap_grad_reduce else None)
        sums = forward_backward(self.model, micro, spec)
        return global_sum(sums.lm_sum, pg.pp), global_sum(sums.indexer, pg.pp)


def train(cfg: RunConfig, *, resume: bool = False, progress: bool = True, tracking_uri: str | None = None,
          max_steps: int | None = None, resume_from: str | Path | None = None, overwrite: bool = False) -> TrainResult:
    """Train with ``cfg``. Call on every rank of the job.

    A run folder that already holds checkpoints is refused unless ``resume`` (its latest),
    ``resume_from`` (a given checkpoint) or ``overwrite`` (its checkpoints are deleted first)."""
    from genome_lm.engine.parallel import ParallelSizes, check_stated_gpus, parallel_context

    sizes, backend, out = ParallelSizes.of(cfg.parallel), current(), Path(cfg.train.out_dir)
    check_run_folder(out, resume=resume, resume_from=resume_from, overwrite=overwrite)
    # memory.host_heap: `genome-lm finetune` resolves auto from the plan (plan.memory_model.host_heap)
    with parallel_context(sizes, host_heap=cfg.memory.host_heap) as pg, _StopFlag() as stop:
        check_stated_gpus(cfg.parallel.gpus, dist.get_world_size())  # torchrun's ranks (Ray's: check_layout)
        rank = dist.get_rank()
        if overwrite and not (resume or resume_from) and rank == 0 and existing_checkpoints(out):
            log.warning("%s: --overwrite: deleting its checkpoints (up to %s) before a new run",
                        out, existing_checkpoints(out)[-1].name)
            shutil.rmtree(out / "checkpoints")
        dist.barrier()
        trainer = Trainer(cfg, pg, sizes, backend)
        folder = resume_point(out, resume_from) if resume or resume_from is not None else None
        state = trainer.restore(folder) if folder is not None else {"step": 0}
        earlier = [StepMetrics(**m) for m in state.get("history", [])]
        result = TrainResult(out_dir=out, steps_done=state["step"], resumed_from=folder, earlier=earlier)
        tracker = Tracker(tracking_uri or cfg.tracking.uri, experiment=cfg.tracking.experiment,
                          run_name=cfg.tracking.run_name or default_run_name(cfg), run_dir=out,
                          run_id=state.get("run_id"), enabled=rank == 0)
        with tracker:
            if result.steps_done == 0:
                tracker.log_config(cfg.resolved())
                tracker.log_params(backend.as_params())
            else:
                tracker.rewind(result.steps_done)  # the steps after the checkpoint are about to run again
            result.run_id = tracker.run_id
            bar = _progress(progress and rank == 0, result.steps_done, cfg.train.steps)
            if bar.enabled:
                bar.note(backend.describe())
            if folder is not None:
                _report(bar, rank, f"resumed from step {result.steps_done} ({folder})")
            last = cfg.train.steps if max_steps is None else min(cfg.train.steps, result.steps_done + max_steps)
            _run_steps(trainer, result, tracker, bar, stop, last, rank)
            bar.close()
            if result.steps_done > state["step"] and (
                    result.checkpoint is None or not result.checkpoint.name.endswith(f"{result.steps_done:06d}")):
                result.checkpoint = trainer.save(out, result.steps_done, tracker.run_id, result.all_steps)
            if result.checkpoint is not None:
                tracker.log_params({"checkpoint": str(result.checkpoint)})
            _log_curve(tracker, result, out, rank)
            result.tracking = tracker.location
            result.run_id = tracker.run_id  # it moves when a lost server's run goes on in the run folder
        return result


def _run_steps(trainer: Trainer, result: TrainResult, tracker, bar, stop: "_StopFlag", last: int,
               rank: int) -> None:
    """Steps from ``result.steps_done`` up to ``last``: metrics to the tracker and the bar, a
    checkpoint every ``train.save_every`` steps; stops early on non-finite losses
    (``train.nonfinite``) or a signal, saying why in ``result.stopped_by``."""
    cfg, bad_in_row = trainer.cfg, 0
    for step in range(result.steps_done, last):
        metrics = trainer.step(step)
        result.history.append(metrics)
        result.steps_done = step + 1
        tracker.log_metrics(metrics.as_metrics(), step=step + 1)
        bar.update(metrics)
        if metrics.skipped:  # every rank agrees: the loss and the gradient norm are global
            bad_in_row += 1
            _report(bar, rank, f"step {step + 1}: non-finite loss or gradient (loss {metrics.lm_loss}, grad norm "
                               f"{metrics.grad_norm}); update skipped")
            if cfg.train.nonfinite == "stop" or bad_in_row >= 3:
                why = "train.nonfinite = stop" if cfg.train.nonfinite == "stop" else "3 in a row"
                _report(bar, rank, f"stopping after step {step + 1}: non-finite loss ({why})")
                result.stopped_by = "non-finite loss"
                return
        else:
            bad_in_row = 0
        if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
            result.checkpoint = trainer.save(Path(cfg.train.out_dir), step + 1, tracker.run_id, result.all_steps)
        signalled = stop.agreed()
        if signalled is not None:
            result.stopped_by = signalled
            return


def _cp_part(batch, cp: int, rank: int):
    """This context-parallel rank's zigzag part of a batch. A length that 2 * cp does not divide
    is padded at the end (PAD inputs, no label, weight 0); the model is causal, so the padding
    changes no real position's loss. Padded tokens do pass through the MoE router and count in
    its expert-load statistics."""
    if cp == 1:
        return batch

    from genome_lm.data.loader import IGNORE, PAD
    from genome_lm.engine.context_parallel import pad_for_cp, zigzag_split

    def part(x, value):
        return zigzag_split(pad_for_cp(x, cp, value), cp, rank)

    return replace(batch, tokens=part(batch.tokens, PAD), labels=part(batch.labels, IGNORE),
                   loss_weight=part(batch.loss_weight, 0.0))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


def _peak_device_mib() -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if on_gpu() else 0.0


def _log_curve(tracker, result: TrainResult, out: Path, rank: int) -> None:
    if rank != 0 or not result.history:
        return
    try:
        import matplotlib
    except ImportError:  # a GPU image without it: the figures are in the history and the tracker
        log.warning("matplotlib is not installed: no loss_curve.png (pip install matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result.all_steps  # a resumed run's curve starts at its first step, not at the resume
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m.step for m in steps], [m.lm_loss for m in steps], label="LM loss")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted cross-entropy (nats)")
    ax.legend()
    fig.tight_layout()
    path = out / "loss_curve.png"
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    tracker.log_artifact(path)
    result.loss_curve = path


def _report(bar, rank: int, text: str) -> None:
    """A note from rank 0: above the progress bar, or a logging warning (stderr) without one."""
    if rank != 0:
        return
    if bar.enabled:
        bar.note(text)
    else:
        log.warning("%s", text)


def _progress(enabled: bool, start: int, total: int):
    return StepProgress(enabled, start, total)
