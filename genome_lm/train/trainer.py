"""The training loop: one function, ``train(config)``, run on every rank.

    process groups (engine.parallel) -> model (model.build_model, HF weights or random)
    -> memory techniques (train.memory) -> megatron-core DDP -> optimizer (train.optim)
    -> for each step: micro-batches from the prepared dataset (data.loader), weighted loss
       normalised by the global batch's weight, backward, megatron-core's finalize_model_grads
       (data-parallel reduction, MoE expert-bias update), clip, step, metrics to MLflow
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
import shutil
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from genome_lm.errors import GenomeLMError

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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {"loss": self.loss, "lm_loss": self.lm_loss, "indexer_loss": self.indexer_loss, "lr": self.lr,
                "grad_norm": self.grad_norm, "tokens_per_s": self.tokens_per_s, "step_seconds": self.seconds,
                "peak_host_mib": self.peak_host_mib, "peak_device_mib": self.peak_device_mib,
                "moe_busiest_expert_over_mean": self.moe_max_over_mean, "skipped": float(self.skipped),
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
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _moe_load(model, group=None, pp_group=None) -> float:
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


def _seq_len(cfg, step: int) -> int:
    length = cfg.data.seq_len
    for start, value in sorted(cfg.data.seq_len_warmup):
        if step >= start:
            length = value
    return length


def build(cfg, pg, sizes):
    """Model (with weights) and its config, for a ``RunConfig``.

    ``model.checkpoint`` may name a Hugging Face glm5_next folder, a genome-lm training checkpoint
    (a folder with ``meta.json``) or a training run folder (its ``checkpoints/latest``). From a
    genome-lm checkpoint only the weights are taken (verified first; the caller starts a new run:
    fresh optimizer, step 0); the architecture is the one it recorded, and its model preset and
    parallel layout must match this run's. The random generators are left as a random
    initialisation would leave them: the new run's seeding is its own."""
    from genome_lm.model import get_preset
    from genome_lm.model.hf_checkpoint import HFCheckpoint, load_hf_checkpoint
    from genome_lm.model.model import build_model

    from .checkpoint import load_weights

    model_cfg = get_preset(cfg.model.preset)
    ckpt = run_ckpt = None
    if cfg.model.checkpoint:
        run_ckpt = _genome_lm_checkpoint(Path(cfg.model.checkpoint))
        if run_ckpt is not None:
            model_cfg = _check_start_checkpoint(run_ckpt, cfg, sizes)
        else:
            ckpt = HFCheckpoint(cfg.model.checkpoint)
            model_cfg = ckpt.config()
    impl = cfg.model.transformer_impl
    if impl == "auto":
        impl = "transformer_engine" if torch.cuda.is_available() and _has_te() else "local"
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    model = build_model(model_cfg, pg, sizes, transformer_impl=impl, kernel_backend=cfg.model.kernel_backend,
                        dtype=dtype, moe_aux_loss_coeff=cfg.train.moe_aux_loss_coeff,
                        moe_aux_loss=cfg.train.moe_aux_loss)
    if ckpt is not None:
        load_hf_checkpoint(model, ckpt.path)
    if run_ckpt is not None:
        load_weights(run_ckpt, model)
    return model


def _genome_lm_checkpoint(path: Path) -> Path | None:
    """The genome-lm training checkpoint ``model.checkpoint`` names: the folder itself when it has
    ``meta.json``, a run folder's ``checkpoints/latest``; None for anything else (Hugging Face)."""
    from .checkpoint import latest_checkpoint

    if (path / "meta.json").is_file():
        return path
    if (path / "checkpoints").is_dir():
        folder = latest_checkpoint(path)
        if folder is None:
            raise GenomeLMError(f"{path}: a training run folder without checkpoints/latest "
                                "(no checkpoint to start from)")
        return folder
    return None


def _check_start_checkpoint(folder: Path, cfg, sizes):
    """Verify a genome-lm checkpoint (every file against its checksum) and check that this run can
    load its weights: the same model preset and parallel layout. Returns its model config."""
    from genome_lm.model.config import ModelConfig

    from .checkpoint import verify, weight_layout

    meta = verify(folder)
    recorded = meta.get("config", {}).get("model", {})
    if "model_config" not in meta or "layout" not in meta or "preset" not in recorded:
        raise GenomeLMError(f"{folder}: meta.json records no model config, preset or layout "
                            "(not a checkpoint written by genome-lm finetune)")
    if recorded["preset"] != cfg.model.preset:
        raise GenomeLMError(f"{folder}: trained with model preset {recorded['preset']!r}, this run has "
                            f"{cfg.model.preset!r} (set model.preset to {recorded['preset']!r})")
    ours = weight_layout(vars(sizes))
    theirs = {k: meta["layout"].get(k) for k in ours}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if theirs != ours or meta.get("world_size") != world:
        def show(layout, n):
            return " ".join(f"{k}={v}" for k, v in layout.items()) + f" on {n} rank(s)"

        raise GenomeLMError(f"{folder}: written with parallel layout {show(theirs, meta.get('world_size'))}, this run "
                            f"has {show(ours, world)}; export it to Hugging Face format first (genome-lm export "
                            f"--run {folder.parent.parent} --checkpoint {folder.name} --out DIR), which loads "
                            "under any layout, and start from that")
    try:
        return ModelConfig.from_hf(meta["model_config"])
    except (ValueError, TypeError) as exc:
        raise GenomeLMError(f"{folder / 'meta.json'}: model_config: {exc}") from None


def token_map(cfg, model) -> torch.Tensor | None:
    """genome-lm id -> model id, when the model has a text vocabulary of its own (a pretrained
    checkpoint): bases become its single-letter tokens (``data.vocab``). None for DNA vocabularies."""
    from genome_lm.data.tokenizer import VOCAB_SIZE

    if model.cfg.vocab_size <= 16 and model.cfg.vocab_size >= VOCAB_SIZE:
        return None
    if not cfg.model.checkpoint:
        raise GenomeLMError(f"model vocabulary of {model.cfg.vocab_size} tokens is not genome-lm's DNA vocabulary, and "
                            "there is no checkpoint tokenizer to map bases onto it")
    from genome_lm.data.vocab import checkpoint_token_map

    return checkpoint_token_map(_tokenizer_folder(Path(cfg.model.checkpoint)), model.cfg.pad_token_id)


def _tokenizer_folder(path: Path) -> Path:
    """Where the tokenizer of ``model.checkpoint`` lives: the folder itself for a Hugging Face
    checkpoint; for a genome-lm run or checkpoint, that of the checkpoint its run started from
    (recorded in its meta.json), followed back to the Hugging Face folder."""
    import json

    seen = set()
    while (folder := _genome_lm_checkpoint(path)) is not None:
        if folder in seen:
            raise GenomeLMError(f"{path}: its runs' model.checkpoint entries form a loop")
        seen.add(folder)
        source = json.loads((folder / "meta.json").read_text()).get("config", {}).get("model", {}).get("checkpoint")
        if not source:
            raise GenomeLMError(f"{folder}: the model has a text vocabulary but its run recorded no pretrained "
                                "checkpoint to take the tokenizer from")
        path = Path(source)
    return path


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _optimizer(cfg, ddp, pg):
    from .optim import CPUAdamW

    if not torch.cuda.is_available():
        return CPUAdamW(ddp, cfg.train, pg)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(**megatron_optimizer_options(cfg, ddp.module.options.dtype)),
                                       [ddp], pg_collection=pg, use_gloo_process_groups=False)
    apply_weight_decay_multipliers(optimizer.param_groups, cfg.train.weight_decay)
    return _MegatronOptimizer(optimizer)


def megatron_optimizer_options(cfg, params_dtype) -> dict:
    """megatron-core's ``OptimizerConfig`` fields for a run (GPU path):

    - ``loss_scale=1.0``: a constant grad scaler, the only way megatron-core's optimizer checks
      the gradients for inf/NaN (across ranks) when training in bf16; without one it clips with
      a NaN norm (which scales nothing) and applies the step;
    - ``use_precision_aware_optimizer`` with ``optimizer_cpu_offload``: the hybrid CPU/GPU
      optimizer reuses that path, and without it the fp32 main parameters stay on the GPU
      (Megatron-LM refuses the combination)."""
    t = cfg.train
    offload = cfg.memory.optimizer_offload
    return dict(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                adam_beta2=t.adam_beta2, clip_grad=t.grad_clip, bf16=cfg.model.dtype == "bf16",
                params_dtype=params_dtype, loss_scale=1.0, use_distributed_optimizer=True,
                optimizer_cpu_offload=offload, use_precision_aware_optimizer=offload)


def apply_weight_decay_multipliers(param_groups, weight_decay: float) -> None:
    """Each group's weight decay from megatron-core's ``wd_mult`` (0 for 1-D parameters and
    biases): megatron-core leaves that to its ``OptimizerParamScheduler``, which genome-lm does
    not use (it sets the learning rate itself), so without this every parameter, norms and
    KDA's ``A_log``/``dt_bias`` included, would decay. The CPU optimizer follows the same rule."""
    for group in param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


class _MegatronOptimizer:
    """megatron-core's optimizer behind the small interface the loop uses (GPU path)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float]:
        ok, norm, _ = self.optimizer.step()
        return bool(ok), float(norm) if norm is not None else float("nan")

    def state_dict(self):
        """megatron-core's optimizer state and, for each distributed optimizer in it, this rank's
        shard of the fp32 main parameters and Adam moments: ``DistributedOptimizer.state_dict()``
        leaves those out (megatron-core saves them apart), and without them a resumed run would
        restart Adam. Tensors, numbers and dtypes only: it loads with ``weights_only=True``.

        Before the first update Adam has no state yet (every step so far was skipped), and
        megatron-core can neither save nor reload that: the checkpoint then says so, and a resume
        starts the optimizer afresh, which is what it is."""
        inner = _inner_optimizers(self.optimizer)
        if not any(len(getattr(o, "state", {})) for o in inner):
            return {"optimizer": None, "param_state": [None] * len(inner), "no_step_yet": True}
        return {"optimizer": self.optimizer.state_dict(), "param_state": [_param_state(o) for o in inner]}

    def load_state_dict(self, state):
        if state.get("no_step_yet"):
            return
        inner = _inner_optimizers(self.optimizer)
        if len(state["param_state"]) != len(inner):
            raise GenomeLMError(f"the checkpoint's optimizer has {len(state['param_state'])} parts, this run's "
                                f"{len(inner)}: resume with the parallel layout it was saved with")
        self.optimizer.load_state_dict(state["optimizer"])
        for optimizer, shard in zip(inner, state["param_state"]):
            if shard is not None:
                optimizer.load_parameter_state_from_dp_reshardable(shard)


def _inner_optimizers(optimizer) -> list:
    """The optimizers inside megatron-core's ``ChainedOptimizer`` (dense and expert parameters),
    or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _param_state(optimizer):
    """A distributed optimizer's shard of main parameters and optimizer states, in megatron-core's
    own per-bucket layout (``get_parameter_state_dp_reshardable``); None for other optimizers.
    Its loader skips entries flagged as padding, a flag its getter does not set: set it."""
    if not hasattr(optimizer, "get_parameter_state_dp_reshardable"):
        return None
    state = optimizer.get_parameter_state_dp_reshardable()
    for key, by_dtype in state.items():
        if isinstance(key, int):  # one grad buffer: {dtype: [bucket: [per-parameter dict]]}
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for tensors in bucket:
                        tensors.setdefault("padding", False)
    return state


def existing_checkpoints(out: Path) -> list[Path]:
    """The step folders of a run folder's checkpoints, oldest first."""
    root = Path(out) / "checkpoints"
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))


def check_run_folder(out: Path, *, resume: bool, resume_from, overwrite: bool) -> None:
    """Refuse to start a new run over an existing one, unless asked to (--overwrite)."""
    if resume or resume_from is not None or overwrite:
        return
    found = existing_checkpoints(out)
    if found:
        raise GenomeLMError(f"{out}: already holds a training run (checkpoints up to {found[-1].name}); continue it "
                            "with --resume, start a new run elsewhere with --set train.out_dir=<new folder>, or "
                            "replace it with --overwrite")


def resume_point(out: Path, resume_from) -> Path:
    """The checkpoint folder to resume from: ``resume_from`` (a checkpoint folder, or its name in
    the run's checkpoints) or the run's latest, verified; a damaged one is an error that names
    the newest intact checkpoint and how to resume from it."""
    from .checkpoint import CheckpointCorrupt, latest_checkpoint, verify

    if resume_from is not None:
        folder = Path(resume_from)
        if not folder.is_dir() and (Path(out) / "checkpoints" / str(resume_from)).is_dir():
            folder = Path(out) / "checkpoints" / str(resume_from)
        if not folder.is_dir():
            raise GenomeLMError(f"{resume_from}: not a checkpoint folder (expected e.g. {out}/checkpoints/step-000020)")
        verify(folder)
        return folder
    try:
        folder = latest_checkpoint(out)
        if folder is None:
            raise GenomeLMError(f"{out}: nothing to resume (no checkpoints/latest)")
        verify(folder)
        return folder
    except CheckpointCorrupt as err:
        intact = None
        for candidate in reversed(existing_checkpoints(out)):
            try:
                verify(candidate)
            except CheckpointCorrupt:
                continue
            intact = candidate
            break
        if intact is None:
            raise CheckpointCorrupt(f"{err}; no intact checkpoint is left in {Path(out) / 'checkpoints'}") from None
        raise CheckpointCorrupt(f"{err}; the newest intact checkpoint is {intact}: resume from it with "
                                f"--resume-from {intact}") from None


def default_run_name(cfg) -> str:
    """The MLflow run's name: the config's, the preset and the run folder (``demo-cpu: tiny (runs/demo-cpu)``)."""
    source = getattr(cfg, "source", None)
    name = Path(source).stem if source else Path(cfg.train.out_dir).name
    return f"{name}: {cfg.model.preset} ({cfg.train.out_dir})"


def train(cfg, *, resume: bool = False, progress: bool = True, tracking_uri: str | None = None,
          max_steps: int | None = None, resume_from: str | Path | None = None, overwrite: bool = False) -> TrainResult:
    """Train with ``cfg`` (a ``config.RunConfig``). Call on every rank of the job.

    A run folder that already holds checkpoints is refused unless ``resume`` (its latest),
    ``resume_from`` (a given checkpoint) or ``overwrite`` (its checkpoints are deleted first)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    from genome_lm.data.loader import TrainLoader
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.model import allreduce_sequence_parallel_grads
    from genome_lm.model.router import set_aux_loss_grad_scale, take_aux_loss
    from genome_lm.tracking import Tracker

    from .checkpoint import load_checkpoint, save_checkpoint
    from .loss import global_sum
    from .memory import apply_memory, offload_saved_tensors, release_host_cache
    from .optim import learning_rate

    p = cfg.parallel
    sizes = ParallelSizes.of(p)
    out = Path(cfg.train.out_dir)
    check_run_folder(out, resume=resume, resume_from=resume_from, overwrite=overwrite)
    with parallel_context(sizes) as pg, _StopFlag() as stop:
        rank = dist.get_rank()
        if overwrite and not (resume or resume_from) and rank == 0 and existing_checkpoints(out):
            log.warning("%s: --overwrite: deleting its checkpoints (up to %s) before a new run",
                        out, existing_checkpoints(out)[-1].name)
            shutil.rmtree(out / "checkpoints")
        dist.barrier()
        dp_cp = pg.dp_cp
        dp_rank, dp_size = pg.dp.rank(), pg.dp.size()
        per_rank = cfg.train.global_batch_size // dp_size
        if cfg.train.global_batch_size % (dp_size * cfg.train.micro_batch_size):
            raise GenomeLMError(f"global_batch_size {cfg.train.global_batch_size} is not a multiple of "
                                f"micro_batch_size x data-parallel size ({cfg.train.micro_batch_size} x {dp_size})")
        cp, cp_rank = pg.cp.size(), pg.cp.rank()
        torch.manual_seed(cfg.train.seed)
        model = build(cfg, pg, sizes)
        n_micro = per_rank // cfg.train.micro_batch_size
        # each micro-batch's auxiliary loss counts 1 / (micro-batches of the global batch); the
        # data- and context-parallel gradient reduction sums (calculate_per_token_loss below)
        set_aux_loss_grad_scale(model, 1.0 / (dp_size * n_micro))
        moe_coeff = cfg.train.moe_aux_loss_coeff
        apply_memory(model, cfg.memory)
        model.tf_config.calculate_per_token_loss = True  # the loss is already normalised globally: sum grads
        ddp = DistributedDataParallel(
            model.tf_config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                           use_distributed_optimizer=torch.cuda.is_available()),
            model, pg_collection=pg)
        optimizer = _optimizer(cfg, ddp, pg)
        to_model = token_map(cfg, model)
        loader = TrainLoader(cfg.data.dataset, cfg.data.train_split, seq_len=_seq_len(cfg, 0),
                             micro_batch_size=cfg.train.micro_batch_size, softmask_weight=cfg.data.softmask_weight,
                             reverse_complement=cfg.data.reverse_complement, max_n_fraction=cfg.data.max_n_fraction,
                             seed=cfg.train.seed, rank=dp_rank, world_size=dp_size)
        start, run_id, folder, earlier = 0, None, None, []
        if resume or resume_from is not None:
            folder = resume_point(out, resume_from)
            state = load_checkpoint(folder, model, optimizer, layout=vars(sizes))
            loader.load_state_dict(state["loader"])
            start, run_id = state["step"], state.get("run_id")
            earlier = [StepMetrics(**m) for m in state.get("history", [])]
        tracker = Tracker(tracking_uri or cfg.tracking.uri, experiment=cfg.tracking.experiment,
                          run_name=cfg.tracking.run_name or default_run_name(cfg), run_dir=out, run_id=run_id,
                          enabled=rank == 0)
        result = TrainResult(out_dir=out, steps_done=start, resumed_from=folder, earlier=earlier)
        with tracker:
            if start == 0:
                tracker.log_config(cfg.resolved())
            else:
                tracker.rewind(start)  # the steps after the checkpoint are about to run again
            run_id = tracker.run_id
            result.run_id = run_id
            steps = cfg.train.steps if max_steps is None else min(cfg.train.steps, start + max_steps)
            bar = _progress(progress and rank == 0, start, cfg.train.steps)
            if folder is not None:
                _report(bar, rank, f"resumed from step {start} ({folder})")
            bad_in_row = 0

            def checkpoint(step):
                meta = {"config": cfg.resolved(), "config_source": cfg.source, "layout": vars(sizes),
                        "model_config": model.cfg.to_hf()}
                history = [dataclasses.asdict(m) for m in result.all_steps]
                return save_checkpoint(out, step, model, optimizer,
                                       {"step": step, "loader": loader.state_dict(), "run_id": tracker.run_id,
                                        "history": history}, meta)

            for step in range(start, steps):
                t0 = time.perf_counter()
                seq_len = _seq_len(cfg, step)
                loader.set_seq_len(seq_len)
                mode = "dense" if step < cfg.train.indexer_dense_steps else cfg.train.indexer_loss
                lr = learning_rate(step, cfg.train)
                optimizer.set_lr(lr)
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                # every CP rank of a data-parallel rank reads the same batches and keeps its zigzag part
                micro = [_cp_part(loader.next_batch(), cp, cp_rank) for _ in range(n_micro)]
                weight = global_sum(sum(b.loss_weight.sum() for b in micro), dp_cp)
                lm_sum = torch.zeros(())
                idx_sum = torch.zeros(())
                tokens = 0
                for batch in micro:
                    if to_model is not None:  # bases -> the checkpoint's single-letter tokens
                        batch.tokens, batch.labels = to_model[batch.tokens], to_model[batch.labels.clamp_min(0)]
                    tokens += int(batch.tokens.numel())
                # indexer_tokens: the model already divides each CP rank's indexer loss by cp
                loss_args = dict(indexer_tokens=seq_len if cp > 1 else None,
                                 indexer_coeff=cfg.train.indexer_loss_coeff / (dp_size * len(micro)))
                if pg.pp.size() > 1:
                    from .pipeline import run_1f1b

                    sums = {"lm": lm_sum, "indexer": idx_sum}
                    with offload_saved_tensors(cfg.memory.offload_activations, cfg.memory.offload_pinned):
                        run_1f1b(model, len(micro), model.stream_shape(*micro[0].tokens.shape),
                                 partial(_stage_loss, model, micro, mode, cfg, weight, pg, sums, **loss_args))
                    lm_sum, idx_sum = global_sum(sums["lm"], pg.pp), global_sum(sums["indexer"], pg.pp)
                else:
                    for batch in micro:
                        with offload_saved_tensors(cfg.memory.offload_activations, cfg.memory.offload_pinned):
                            parts = _forward_loss(model, batch, mode, cfg, weight, pg, **loss_args)
                            parts.total.backward()
                        lm_sum += parts.lm_sum.float().cpu()
                        idx_sum += parts.indexer.float().cpu() / len(micro)
                release_host_cache()
                moe_load = _moe_load(model, pg.tp_dp_cp, pg.pp)  # read before finalize_model_grads resets the counts
                allreduce_sequence_parallel_grads(model)
                finalize_model_grads([ddp], pg_collection=pg)
                lm = float(global_sum(lm_sum, dp_cp) / weight)
                idx = float(global_sum(idx_sum, dp_cp)) / dp_size
                # this rank's share: tensor/context-parallel ranks and pipeline stages hold parts
                aux = take_aux_loss(model)
                moe_aux = float(global_sum(aux, None)) / (dp_size * n_micro) if moe_coeff > 0 else None  # all ranks
                stepped, norm = optimizer.step() if math.isfinite(lm) else (False, float("nan"))
                tokens_all = int(global_sum(torch.tensor(float(tokens)), dp_cp))  # TP ranks share their tokens
                total = lm + cfg.train.indexer_loss_coeff * idx + (moe_coeff * moe_aux if moe_aux else 0.0)
                metrics = StepMetrics(step + 1, total, lm, idx, lr, norm, tokens_all, time.perf_counter() - t0,
                                      not stepped, _peak_host_mib(), _peak_device_mib(), moe_load, moe_aux)
                result.history.append(metrics)
                result.steps_done = step + 1
                tracker.log_metrics(metrics.as_metrics(), step=step + 1)
                bar.update(metrics)
                if not stepped:  # every rank agrees: the loss and the gradient norm are global
                    bad_in_row += 1
                    _report(bar, rank, f"step {step + 1}: non-finite loss or gradient (loss {lm}, grad norm {norm}); "
                                       "update skipped")
                    if cfg.train.nonfinite == "stop" or bad_in_row >= 3:
                        why = "train.nonfinite = stop" if cfg.train.nonfinite == "stop" else "3 in a row"
                        _report(bar, rank, f"stopping after step {step + 1}: non-finite loss ({why})")
                        result.stopped_by = "non-finite loss"
                        break
                else:
                    bad_in_row = 0
                if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
                    result.checkpoint = checkpoint(step + 1)
                signalled = stop.agreed()
                if signalled is not None:
                    result.stopped_by = signalled
                    break
            bar.close()
            if result.checkpoint is None or not result.checkpoint.name.endswith(f"{result.steps_done:06d}"):
                if result.steps_done > start:
                    result.checkpoint = checkpoint(result.steps_done)
            if result.checkpoint is not None:
                tracker.log_params({"checkpoint": str(result.checkpoint)})
            _log_curve(tracker, result, out, rank)
            result.tracking = tracker.location
            result.run_id = tracker.run_id  # it moves when a lost server's run goes on in the run folder
        return result


def _forward_loss(model, batch, mode, cfg, weight, pg, *, indexer_tokens, indexer_coeff):
    """The step's loss parts for one micro-batch: the model and the weighted cross-entropy."""
    h, indexer_losses = model.hidden(batch.tokens.to(_device()), mode, indexer_tokens)
    return _head_loss(model, h, batch, indexer_losses, cfg, weight, pg, indexer_coeff)


def _stage_loss(model, micro, mode, cfg, weight, pg, sums, i, streams, *, indexer_tokens, indexer_coeff):
    """One pipeline stage's forward of micro-batch ``i`` (``pipeline.run_1f1b``): the streams
    for the next stage and this stage's loss term (its indexer losses; on the last stage the
    weighted cross-entropy too). Adds the detached parts to ``sums``."""
    batch = micro[i]
    out, losses = model.hidden(batch.tokens.to(_device()) if model.pre_process else None, mode, indexer_tokens,
                               streams=streams, positions=batch.tokens.shape[1])
    if losses:
        sums["indexer"] += sum(loss.detach() for loss in losses).float().cpu() / len(micro)
    if not model.post_process:
        return out, indexer_coeff * sum(losses) if losses else None
    parts = _head_loss(model, out, batch, losses, cfg, weight, pg, indexer_coeff)
    sums["lm"] += parts.lm_sum.float().cpu()
    return None, parts.total


def _head_loss(model, h, batch, indexer_losses, cfg, weight, pg, indexer_coeff):
    """Loss parts from the final hidden states: the output layer and the weighted cross-entropy,
    in blocks of ``memory.loss_chunk`` positions when set, plus the indexer losses."""
    from .loss import chunked_lm_loss, lm_loss

    labels, weights = batch.labels.to(_device()), batch.loss_weight.to(_device())
    if cfg.memory.loss_chunk:
        return chunked_lm_loss(model.output_layer, h, labels, weights, global_weight=weight,
                               chunk=cfg.memory.loss_chunk, indexer_losses=indexer_losses,
                               indexer_coeff=indexer_coeff, tp_group=pg.tp)
    return lm_loss(model.output_layer(h)[0].transpose(0, 1), labels, weights, global_weight=weight,
                   indexer_losses=indexer_losses, indexer_coeff=indexer_coeff, tp_group=pg.tp)


def _cp_part(batch, cp: int, rank: int):
    """This context-parallel rank's zigzag part of a batch. A length that 2 * cp does not divide
    is padded at the end (PAD inputs, no label, weight 0); the model is causal, so the padding
    changes no real position's loss. Padded tokens do pass through the MoE router and count in
    its expert-load statistics."""
    if cp == 1:
        return batch
    from dataclasses import replace

    from genome_lm.data.loader import IGNORE, PAD
    from genome_lm.engine.context_parallel import pad_for_cp, zigzag_split

    def part(x, value):
        return zigzag_split(pad_for_cp(x, cp, value), cp, rank)

    return replace(batch, tokens=part(batch.tokens, PAD), labels=part(batch.labels, IGNORE),
                   loss_weight=part(batch.loss_weight, 0.0))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _peak_device_mib() -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0


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

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m.step for m in result.history], [m.lm_loss for m in result.history], label="LM loss")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted cross-entropy (nats)")
    ax.legend()
    fig.tight_layout()
    path = out / "loss_curve.png"
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    tracker.log_artifact(path)


def _report(bar, rank: int, text: str) -> None:
    """A note from rank 0: above the progress bar, or a logging warning (stderr) without one."""
    if rank != 0:
        return
    if bar.enabled:
        bar.note(text)
    else:
        log.warning("%s", text)


def _progress(enabled: bool, start: int, total: int):
    from genome_lm.progress import StepProgress

    return StepProgress(enabled, start, total)
