"""Preflight's model-level parity rows (``precision``), and the sections ``slice`` (a real-size
step's peak against the plan) and ``resume``."""

from __future__ import annotations

import math

import numpy as np

from genome_lm.data.windows import WindowSpec
from genome_lm.engine.devices import spec_of
from genome_lm.model.presets import get_preset
from genome_lm.plan.measure import measure_gpu_step, measure_step, planned_gpu_step, predicted_gpu_step_seconds

from .sections import Skip

PLAN_TOLERANCE = 0.15  # measured peak within 15% of the plan
# the model-level comparison on a GPU: GLM-5.3-Flash's layers at their real size (4 layers: 3 KDA
# and a DSA layer with its indexer choosing 512 of 1,024 pools at 4k, the MoE's 8 of 64 experts,
# fewer than its 288 so that an fp32 and a bf16 copy fit one GPU with room to spare)
GPU_PRECISION = dict(preset="glm-5.3-flash-4layer", n_routed_experts=64, T=4096)
CPU_PRECISION = dict(preset="tiny-long", T=130)


def precision(ctx) -> list[dict]:
    """The whole model through the tensor-core path (bf16 parameters and activations, the Triton
    kernels) against its fp32 torch path on the same weights and tokens
    (``compare.precision.compare_precision``), judged by ``compare.precision.bounds``: the
    kernels' rounding with every MoE routing and DSA selection replayed from the fp32 run, and the
    flips that rounding causes on near-ties counted, with the bound before the first one. On a
    GPU at a real layer size; on a CPU the tiny-long preset under Triton's interpreter."""
    from genome_lm.compare.precision import bounds, compare_precision, exceeded

    setting = dict(GPU_PRECISION if ctx.gpu else CPU_PRECISION)
    name, T = setting.pop("preset"), setting.pop("T")
    cfg = get_preset(name).replace(**setting)
    r = compare_precision(cfg, T, seed=0)
    b = bounds(r, cfg)
    over = exceeded(r, b)
    shape = f"{name}{''.join(f' {k}={v}' for k, v in setting.items())} T{T}"
    return [{"op": "model (bf16, decisions replayed)", "backend": "triton", "shape": shape,
             "reference": "torch path, fp32, same weights", "worst": "logits (relative)", "rel_err": r.rel_logit,
             "bound": b.rel_logit, "ok": not over, "max_abs_logprob": r.max_abs_logprob,
             "max_abs_logprob_bound": b.max_abs_logprob, "loss_rel_diff": r.loss_rel_diff,
             "loss_replayed_rel_diff": r.loss_replayed_rel_diff, "routing_flips": r.routing_flips,
             "selection_flips": r.selection_flips, "decisions": r.decisions, "first_flip": r.first_flip,
             "max_abs_logprob_before_flip": r.max_abs_logprob_before_flip,
             **({"problem": "; ".join(over)} if over else {})}]


def slice_peak(ctx) -> tuple[list[dict], str]:
    """GPU: the 4-layer slice of GLM-5.3-Flash (random weights, the shipped 1-GPU config's memory
    switches), one training step at 32k: ``torch.cuda.max_memory_allocated`` against the plan,
    and its time against the time model's (``plan.time_model``; the measured step over the
    predicted one says how far the model's efficiencies are from this GPU's kernels).
    CPU: the tiny model at 2k through the planner's own CPU measurement (resident-set peak), its
    time beside its FLOPs at this CPU's measured matmul rate."""
    from genome_lm.config import load_config
    from genome_lm.plan.memory_model import with_changes

    if ctx.gpu:
        import torch


        run = with_changes(load_config("glm-5.3-flash-4layer-1gpu", ["model.checkpoint=null"]), data={"seq_len": 32768})
        planned = planned_gpu_step(run)
        got = measure_gpu_step(run)
        measured, seconds = got.peak_bytes, got.seconds
        spec = spec_of(torch.cuda.get_device_name())
        predicted = predicted_gpu_step_seconds(run, spec.name) if spec else None
        what = "glm-5.3-flash-4layer, 32k tokens, bf16, the 1-GPU config's memory switches"
    else:
        from genome_lm.plan.sweep import cpu_matmul_rate, predicted_step, step_flops

        run = with_changes(load_config("demo-cpu", ["train.global_batch_size=1"]), data={"seq_len": 2048})
        planned = predicted_step(run)
        got = measure_step(run)
        measured, seconds = got.peak_bytes, got.seconds
        predicted = step_flops(run) / cpu_matmul_rate(1)  # measure_step runs one thread
        what = "tiny, 2k tokens, fp32 (resident-set peak of a fresh process; time: FLOPs at the matmul rate)"
    ratio = measured / planned
    row = {"model": what, "planned_gib": planned / 2**30, "measured_gib": measured / 2**30,
           "measured_over_plan": ratio, "ok": abs(ratio - 1) <= PLAN_TOLERANCE, "measured_s": seconds,
           "predicted_s": predicted, "measured_over_predicted_s": seconds / predicted if predicted else None}
    return [row], f"measured within {PLAN_TOLERANCE:.0%} of the plan" if row["ok"] else "plan and measurement disagree"


def _dataset(ctx):
    """A small prepared dataset of random DNA (needs pysam for the FASTA), or the one given."""

    if ctx.dataset is not None:
        return ctx.dataset
    try:
        import pysam  # noqa: F401
    except ImportError:
        raise Skip("pysam is not installed, so no dataset can be prepared here: pip install pysam, "
                   "or pass --dataset with a folder made by genome-lm prepare") from None
    from genome_lm.data.prepare import PrepareRequest, prepare

    rng = np.random.default_rng(11)
    root = ctx.work_dir / "data"
    root.mkdir(parents=True, exist_ok=True)
    fasta = root / "random.fa"
    with fasta.open("w") as f:
        for name, length in (("chr1", 12000), ("chr2", 6000), ("chr22", 3000)):
            seq = "".join(rng.choice(list("ACGTacgt"), length))
            f.write(f">{name}\n" + "\n".join(seq[i:i + 60] for i in range(0, length, 60)) + "\n")
    spec = WindowSpec(2048, 2048, "keep", min_tail=100, max_n_fraction=1.0)
    prepare(PrepareRequest(fasta, root / "ds", ("chr1", "chr2"), ("chr22",), spec), workers=1, quiet=True,
            cache_dir=root / "cache")
    return root / "ds"


def resume(ctx) -> tuple[list[dict], str]:
    """The tiny model through the real trainer (on a GPU: bf16, Triton kernels, megatron-core's
    distributed optimizer): 4 steps, and 2 steps then ``--resume`` for 2 more. The losses and
    gradient norms must be the same bit for bit, or the difference explained: when two identical
    4-step runs differ too (atomic additions in the sparse attention's backward add in a
    different order each run), resuming may differ by no more than that."""
    from genome_lm.config import load_config
    from genome_lm.train.trainer import train

    dataset = _dataset(ctx)

    def config(out: str):
        return load_config("demo-cpu", [
            f"data.dataset={dataset}", f"train.out_dir={ctx.work_dir / out}", "train.steps=4", "train.save_every=2",
            f"data.seq_len={1024 if ctx.gpu else 256}", "train.global_batch_size=2", "train.warmup_steps=1",
            "train.indexer_dense_steps=1", f"model.dtype={'bf16' if ctx.gpu else 'fp32'}", "model.kernel_backend=auto"])

    full = train(config("full"), progress=False)
    part = train(config("part"), progress=False, max_steps=2)
    rest = train(config("part"), progress=False, resume=True)
    straight = [(m.loss, m.grad_norm) for m in full.history]
    resumed = [(m.loss, m.grad_norm) for m in part.history + rest.history]
    rows = [{"step": i + 1, "loss_straight": a[0], "loss_resumed": b[0], "grad_norm_straight": a[1],
             "grad_norm_resumed": b[1]} for i, (a, b) in enumerate(zip(straight, resumed))]
    if straight == resumed:
        return rows, "bit-exact: the resumed run repeats the straight run's losses and gradient norms"
    again = [(m.loss, m.grad_norm) for m in train(config("again"), progress=False).history]
    run_to_run = _largest_gap(straight, again)
    gap = _largest_gap(straight, resumed)
    ok = run_to_run > 0 and gap <= 4 * run_to_run
    rows.append({"step": "largest relative gap", "resumed_vs_straight": gap, "two_straight_runs": run_to_run, "ok": ok})
    why = ("not bit-exact, explained: two identical straight runs differ by {:.1e} (the sparse attention's backward "
           "adds with atomics, in a different order each run); resuming differs by {:.1e}").format(run_to_run, gap)
    return rows, why if ok else f"resuming changes the run: {gap:.1e} against {run_to_run:.1e} between identical runs"


def _largest_gap(a: list[tuple], b: list[tuple]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for ra, rb in zip(a, b) for x, y in zip(ra, rb)
                if math.isfinite(x) and math.isfinite(y)), default=0.0)
