"""Measured peak memory and time of one training step of a model on this CPU, for checking the
planner (``tests/plan``) and for ``genome-lm bench sweep``; ``measure_pipeline_step`` measures
each stage of a pipeline-parallel step.

One forward + backward of ``RunConfig``'s model (random weights, random DNA tokens) with its
memory switches applied, in a fresh Python process, so that nothing an earlier measurement
allocated is counted. The step is the trainer's own (``train_step``: ``train.step``), with the
loss, the indexer loss and the switches that act on the step as training applies them. A shorter warm-up step runs first
(its gradients dropped): the first
step pages in ~30 MiB of library code and leaves ~10 MiB of one-time library buffers, an amount
that differs from one CPU to the next (CI measured 23 MiB more than this machine) and that is not
the step's tensors. Peak: the process's resident-set high-water mark (``/proc`` VmHWM, reset
after the warm-up) minus the resident set at that point, i.e. what the step added.

glibc's malloc keeps freed blocks below its mmap threshold for reuse, and raises that threshold
(up to 32 MiB) each time a larger block is freed, so a freed tensor often stays resident and
the high-water mark tracks the allocator's history rather than the tensors alive at once. The
worker therefore runs with ``MALLOC_MMAP_THRESHOLD_=65536``: every tensor over 64 KiB is its own
mapping, returned to the system when freed, so the resident set follows the live tensors, the
quantity ``torch.cuda.max_memory_allocated`` reports on a GPU and the planner predicts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from genome_lm.engine.backend import current
from genome_lm.measure import Peak, run_fresh, run_fresh_ranks, serve
from genome_lm.plan.hardware import gpu_spec

if TYPE_CHECKING:
    from genome_lm.config import RunConfig
    from genome_lm.model.model import GLM5Model

MMAP_THRESHOLD = "65536"
WARM_UP_TOKENS = 8192  # long enough to take every kernel path (DSA's gathered blocks start at 2k)


@dataclass
class Measured:
    seq_len: int
    seconds: float
    peak_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.seq_len / self.seconds


def _timed_peak(model: GLM5Model, step, T: int, barrier=None) -> tuple[float, int]:
    """Seconds and added resident bytes of ``step(T)`` (``genome_lm.measure.Peak``), after a
    warm-up ``step`` (its gradients dropped) that pages in the code and the libraries' one-time
    buffers; ``barrier``: all ranks reset their high-water marks before any of them starts."""
    step(min(T, WARM_UP_TOKENS))
    model.zero_grad(set_to_none=True)
    with Peak(barrier) as peak:
        step(T)
    return peak.seconds, peak.bytes


WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}


def random_batches(run: RunConfig, n_micro: int, device: str = "cpu") -> list:
    """``n_micro`` micro-batches of random DNA ids (4..7) of ``data.seq_len`` inputs: targets the
    next token, weight 1 each (``train.step.Tokens``)."""
    import torch

    from genome_lm.train.step import Tokens

    T, B = run.data.seq_len, run.train.micro_batch_size
    ids_NBL = torch.randint(4, 8, (n_micro, B, T + 1), device=device)
    return [Tokens(ids[:, :-1], ids[:, 1:], torch.ones(B, T, device=device)) for ids in ids_NBL]


def train_step(model: GLM5Model, run: RunConfig, micro: list, *, pin_offload: bool = False):
    """The trainer's step (``train.step.forward_backward``) of ``run`` over ``micro``, as the
    trainer runs it when these micro-batches are a whole global batch on one data-parallel rank:
    the loss normalised by their total weight, ``train.indexer_loss`` (the mode after the dense
    warm-up) with ``train.indexer_loss_coeff`` shared among them, the config's memory switches.
    ``pin_offload`` False: offloaded activations stay in pageable memory even where a GPU could
    pin them (a CPU measurement must not start CUDA). Returns ``train.step.StepSums``."""
    import torch

    from genome_lm.train.step import forward_backward, step_spec

    weight = sum(b.loss_weight.sum() for b in micro)
    memory = run.memory if pin_offload else run.memory.model_copy(update={"offload_pinned": False})
    spec = step_spec(run, global_weight=torch.as_tensor(weight), micro_batches=len(micro), tp_group=model.pg.tp,
                     memory=memory)
    return forward_backward(model, micro, spec)


def build_measured(run: RunConfig, pg, sizes, *, n_micro: int = 1, device: str = "cpu", dtype=None,
                   transformer_impl: str = "local", kernel_backend: str = "torch") -> GLM5Model:
    """``run``'s model (random weights, seeded with ``train.seed``) with its memory switches
    applied and, with ``train.moe_aux_loss_coeff`` > 0, its MoE auxiliary loss as the trainer
    builds it (scaled for ``n_micro`` micro-batches), and with ``peft.method: lora`` its base
    frozen under adapters (``model.peft.apply_lora``, as ``checkpoint.build`` does).
    ``dtype`` None: ``model.dtype``."""
    import torch

    from genome_lm.model.model import build_model
    from genome_lm.model.router import set_aux_loss_grad_scale
    from genome_lm.plan.memory_model import model_config
    from genome_lm.train.memory import apply_memory

    torch.manual_seed(run.train.seed)
    if dtype is None:
        dtype = torch.bfloat16 if run.model.dtype == "bf16" else torch.float32
    model = build_model(model_config(run), pg, sizes, transformer_impl=transformer_impl,
                        kernel_backend=kernel_backend, dtype=dtype, device=device,
                        moe_aux_loss_coeff=run.train.moe_aux_loss_coeff, moe_aux_loss=run.train.moe_aux_loss)
    set_aux_loss_grad_scale(model, 1.0 / n_micro)
    if run.peft.method == "lora":
        from genome_lm.model.peft import apply_lora

        apply_lora(model, run.peft, seed=run.train.seed)
    apply_memory(model, run.memory)
    return model


def _first(micro: list, n: int) -> list:
    """The micro-batches cut to their first ``n`` positions (the warm-up step's shorter length)."""
    return [type(b)(b.tokens[:, :n], b.labels[:, :n], b.loss_weight[:, :n]) for b in micro]


def _worker(spec: dict) -> dict:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch

    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes, parallel_context

    torch.set_num_threads(spec["threads"])
    run = RunConfig.model_validate_json(spec["run"])
    T = run.data.seq_len
    with parallel_context() as pg:
        model = build_measured(run, pg, ParallelSizes())
        micro = random_batches(run, 1)

        def step(n: int) -> None:
            train_step(model, run, _first(micro, n))

        seconds, peak = _timed_peak(model, step, T)
    return {"seq_len": T, "seconds": seconds, "peak_bytes": peak}


def _pipeline_worker(spec: dict) -> dict:
    """One pipeline rank of ``measure_pipeline_step``: the trainer's step (the 1F1B schedule,
    ``train.pipeline.run_1f1b``) over ``global_batch_size / micro_batch_size`` micro-batches."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch

    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes, init_distributed, parallel_context

    torch.set_num_threads(spec["threads"])
    run = RunConfig.model_validate_json(spec["run"])
    T, n_micro = run.data.seq_len, run.train.global_batch_size // run.train.micro_batch_size
    init_distributed(spec["rank"], run.parallel.pp, init_method=spec["init_method"])
    sizes = ParallelSizes(pp=run.parallel.pp)
    with parallel_context(sizes) as pg:
        model = build_measured(run, pg, sizes, n_micro=n_micro)
        micro = random_batches(run, n_micro)

        def step(n: int) -> None:
            train_step(model, run, _first(micro, n))

        seconds, peak = _timed_peak(model, step, T, barrier=torch.distributed.barrier)
    return {"seq_len": T * n_micro, "seconds": seconds, "peak_bytes": peak}


def measure_pipeline_step(run: RunConfig, threads: int = 1, timeout: float = 900) -> list[Measured]:
    """One training step of ``run`` split into ``parallel.pp`` pipeline stages, one process per
    stage (gloo), all its micro-batches through the 1F1B schedule: each stage's peak, measured as
    in ``measure_step``. ``parallel`` must hold pipeline parallel only (data parallel 1)."""
    from genome_lm.engine.parallel import free_port

    p = run.parallel
    if (p.tp, p.cp, p.ep, p.etp) != (1, 1, 1, 1):
        raise ValueError("measure_pipeline_step measures pipeline parallel alone")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    payloads = [{"run": run.model_dump_json(), "threads": threads, "rank": rank, "init_method": init_method,
                 "pipeline": True} for rank in range(p.pp)]
    results = run_fresh_ranks("genome_lm.plan.measure", payloads, timeout=timeout, env=WORKER_ENV)
    return [Measured(**r) for r in results]


def measure_step(run: RunConfig, threads: int = 1, timeout: float = 600) -> Measured:
    """Run one step of ``run`` (a ``RunConfig``) in a fresh process; see the module docstring."""
    spec = {"run": run.model_dump_json(), "threads": threads}
    return Measured(**run_fresh("genome_lm.plan.measure", spec, timeout=timeout, env=WORKER_ENV))


class GPUStep(NamedTuple):
    peak_bytes: int  # the allocator's peak during the timed step, above what was allocated before it
    seconds: float  # the timed step (the second one: the first compiles the Triton kernels)


def measure_gpu_step(run: RunConfig, device: str = "cuda") -> GPUStep:
    """Peak bytes and seconds of one training step of ``run``'s model (random weights, bf16, the
    config's kernel backend, Transformer Engine as ``engine.backend`` resolves it, the memory
    switches as the trainer applies them: ``train_step``, one micro-batch of
    ``train.micro_batch_size``) on a GPU. A first step compiles the kernels and warms the
    allocator; the second is measured: the allocator's peak during it
    (``torch.cuda.max_memory_allocated``) minus what was allocated before it (the parameters),
    and its time. Gradients stay plain bf16 ``.grad`` tensors (see ``planned_gpu_step``)."""
    import torch

    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.train.memory import release_host_cache

    with parallel_context() as pg:
        model = build_measured(run, pg, ParallelSizes(), device=device, dtype=torch.bfloat16,
                               transformer_impl=current().resolve_impl(run.model.transformer_impl),
                               kernel_backend=run.model.kernel_backend)
        micro = random_batches(run, 1, device=device)
        train_step(model, run, micro, pin_offload=True)  # warm-up: kernel compilation, allocator growth
        model.zero_grad(set_to_none=True)
        release_host_cache()  # as the trainer does after each step
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train_step(model, run, micro, pin_offload=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - before
        release_host_cache()
        del model, micro
        torch.cuda.empty_cache()
    return GPUStep(peak, seconds)


def predicted_gpu_step_seconds(run: RunConfig, gpu_name: str) -> float:
    """The time model's figure for ``measure_gpu_step``'s timed step on one ``gpu_name`` GPU:
    the step's compute, memory and host transfers (with the pinning of the offloaded blocks),
    without the optimizer step, which ``measure_gpu_step`` does not run."""
    from genome_lm.plan.memory_model import Hardware
    from genome_lm.plan.time_model import estimate_time

    timing = estimate_time(run, Hardware(gpu_name=gpu_name, gpus=1), gpu_spec(gpu_name))
    return sum(i.seconds for i in timing.items if not i.name.startswith("optimizer"))


def planned_gpu_step(run: RunConfig) -> float:
    """The plan's figure for ``measure_gpu_step``: its activation peak plus the gradients as plain
    bf16 ``.grad`` tensors (2 bytes per parameter; the trainer's megatron-core DDP keeps fp32)."""
    from genome_lm.plan.memory_model import Hardware, estimate

    plan = estimate(run, Hardware(device="gpu"))
    activations = next(i.bytes for i in plan.device if i.name.startswith("activations"))
    return activations + plan.params_local * 2


if __name__ == "__main__":
    serve(lambda spec: _pipeline_worker(spec) if spec.get("pipeline") else _worker(spec))
