"""On this CPU: the planner's peak of each pipeline stage next to the measured peak of a real
pipeline-parallel training step of the tiny model (one gloo process per stage, the trainer's
1F1B schedule; ``genome_lm.plan.measure.measure_pipeline_step``).

    .venv/bin/python benchmarks/plan_pipeline_check.py                                  # 4k and 8k, pp 2
    .venv/bin/python benchmarks/plan_pipeline_check.py --lengths 8k --set memory.recompute=full
    .venv/bin/python benchmarks/plan_pipeline_check.py --pp 4 --micro-batches 8

Planned: gradients plus the activation peak of ``plan.memory_model.stage_plans`` for the stage
(with its micro-batches in flight); measured: what the step adds to the process's resident set.
``tests/plan/test_pipeline_plan.py`` checks one case; this script prints a table of several.
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4k,8k", help="tokens per micro-batch (k suffix)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (tiny has 4 layers: 2 or 4)")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. memory.recompute=full")
    args = ap.parse_args()

    from genome_lm.config import load_config
    from genome_lm.plan.measure import measure_pipeline_step
    from genome_lm.plan.memory_model import Hardware, stage_plans
    from genome_lm.units import parse_size

    print(f"tiny, pp {args.pp}, {args.micro_batches} micro-batches, one process per stage; {' '.join(args.set)}")
    print(f"{'length':>8} {'stage':>5} {'layers':>7} {'in flight':>9} {'planned MiB':>11} {'measured MiB':>12} "
          f"{'plan/measured':>13} {'step s':>7}")
    for text in args.lengths.split(","):
        T = parse_size(text)
        run = load_config("demo-cpu", [f"parallel.pp={args.pp}", f"train.global_batch_size={args.micro_batches}",
                                       f"data.seq_len={T}", *args.set])
        measured = measure_pipeline_step(run)
        for plan, got in zip(stage_plans(run, Hardware(device="cpu", gpus=args.pp)), measured, strict=True):
            want = sum(i.bytes for i in plan.device if i.name.startswith(("gradients", "activations")))
            layers = f"{plan.layers.start}-{plan.layers.stop - 1}"
            print(f"{text:>8} {plan.stage:>5} {layers:>7} {plan.in_flight:>9} {want / 2**20:>11,.0f} "
                  f"{got.peak_bytes / 2**20:>12,.0f} {want / got.peak_bytes:>12.2f}x {got.seconds:>7.1f}")


if __name__ == "__main__":
    main()
