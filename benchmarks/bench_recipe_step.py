"""The long-context recipe's training steps on this CPU, this checkout against another one in the
same run: stage 1 (tiny-long, 8 sequences of 256 bases) and stage 2 at its longest crops (one
sequence of 8,192), each forward + backward with the dense indexer loss, as
`configs/long-context-*.yaml` train.

Each checkout runs in fresh processes with only its own source on the path (PYTHONPATH = the
checkout and its kernels/ folder), alternating between the two so that machine noise hits both
alike. A process builds the model from the same seed, warms up one step, then times --steps
steps; the table shows the median over every timed step of every process, the ratio baseline /
this (above 1: this checkout is faster), and both checkouts' losses, which must agree (the same
weights and tokens; the last digits may differ where the arithmetic was reordered).

    git worktree add /tmp/baseline <commit>
    .venv/bin/python benchmarks/bench_recipe_step.py --baseline /tmp/baseline --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"stage 1": (8, 256), "stage 2": (1, 8192)}  # (sequences, bases) per step

WORKER = r"""
import json, sys, time
import torch
import torch.nn.functional as F
from genome_lm.engine import quiet_megatron_import
with quiet_megatron_import():
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model.model import build_model
from genome_lm.model.presets import get_preset

B, T, steps, threads = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)
torch.manual_seed(0)
with parallel_context() as pg:
    model = build_model(get_preset("tiny-long"), pg, ParallelSizes(), kernel_backend="torch").train()
    ids = torch.randint(4, 9, (B, T), generator=torch.Generator().manual_seed(1))
    times, loss = [], None
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = model(ids, indexer_loss="dense")
        lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        (lm + sum(out.indexer_losses)).backward()
        if step:  # the first step is the warm-up
            times.append(time.perf_counter() - start)
        loss = [lm.item()] + [x.item() for x in out.indexer_losses]
print(json.dumps({"times": times, "loss": loss}))
"""


def run_once(root: Path, B: int, T: int, steps: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "kernels")]))
    done = subprocess.run([sys.executable, "-c", WORKER, str(B), str(T), str(steps), str(threads)], cwd=root,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{root}: the worker failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per checkout and shape, alternating")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process (after one warm-up)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    sides = {"this": REPO, "baseline": args.baseline.resolve()}
    print(f"this: {REPO}\nbaseline: {sides['baseline']}\ntorch threads: {args.threads}; "
          f"{args.rounds} rounds x {args.steps} timed steps per checkout and shape")
    print(f"{'step':8s} {'B x T':>9s} {'baseline s':>11s} {'this s':>8s} {'ratio':>6s}  "
          "losses (LM, indexer): baseline | this")
    for name, (B, T) in SHAPES.items():
        times = {side: [] for side in sides}
        losses = {}
        for _ in range(args.rounds):
            for side, root in sides.items():
                result = run_once(root, B, T, args.steps, args.threads)
                times[side] += result["times"]
                losses[side] = result["loss"]
        base, this = statistics.median(times["baseline"]), statistics.median(times["this"])
        shown = " | ".join(", ".join(f"{x:.6f}" for x in losses[s]) for s in ("baseline", "this"))
        print(f"{name:8s} {B:>3d} x {T:<5d} {base:11.3f} {this:8.3f} {base / this:6.2f}  {shown}")


if __name__ == "__main__":
    main()
