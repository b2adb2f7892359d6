"""The default demo's CPU work, this checkout against another one in the same run: its training step
(tiny-long, two micro-batches of 4,096 bases with the dense indexer loss, through the trainer's
own ``train.step.forward_backward``) and its two eval passes over one 32k window (the whole window
in one forward, and the context cut to 256 bases, ``eval --max-context 256``).

Each checkout runs in fresh processes with only its own source on the path (PYTHONPATH = the
checkout and its kernels/ folder), alternating between the two so that machine noise hits both
alike. A process builds the model from the same seed, warms each pass up once, then times
--repeats of it; the table shows the median over every timed repeat of every process, the ratio
baseline / this (above 1: this checkout is faster), and both checkouts' losses, which must agree
(the same weights and tokens; the last digits may differ where the arithmetic was reordered).

    git worktree add /tmp/baseline <commit>
    .venv/bin/python benchmarks/bench_demo_step.py --baseline /tmp/baseline --rounds 3
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
PASSES = ("train step", "eval whole", "eval cut 256")

WORKER = r"""
import json, sys, time
import numpy as np
import torch
from genome_lm.engine import quiet_megatron_import
with quiet_megatron_import():
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.config import MemoryConfig
from genome_lm.eval.score import token_nll, token_nll_cut
from genome_lm.model.model import build_model
from genome_lm.model.presets import get_preset
from genome_lm.train.step import StepSpec, Tokens, forward_backward

repeats, threads, window = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
torch.manual_seed(0)
gen = torch.Generator().manual_seed(1)
micro = []
for _ in range(2):  # the demo's global batch: 2 micro-batches of 1 x 4,096
    ids = torch.randint(4, 9, (1, 4097), generator=gen)
    micro.append(Tokens(ids[:, :-1], ids[:, 1:], torch.ones(1, 4096)))
spec = StepSpec(memory=MemoryConfig(), mode="dense", global_weight=torch.tensor(2 * 4096.0))
tokens = np.random.default_rng(2).integers(0, 4, window + 1)
results = {}
with parallel_context() as pg:
    model = build_model(get_preset("tiny-long"), pg, ParallelSizes(), kernel_backend="torch")

    def train_step():
        model.train()
        model.zero_grad(set_to_none=True)
        sums = forward_backward(model, micro, spec)
        return [float(sums.lm_sum) / 8192, float(sums.indexer)]

    def whole():
        model.eval()
        return [float(token_nll(model, tokens).mean())]

    def cut():
        model.eval()
        return [float(token_nll_cut(model, tokens, 256).mean())]

    for name, fn in (("train step", train_step), ("eval whole", whole), ("eval cut 256", cut)):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            loss = fn()
            times.append(time.perf_counter() - start)
        results[name] = {"times": times, "loss": loss}
print(json.dumps(results))
"""


def run_once(root: Path, repeats: int, threads: int, window: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "kernels")]))
    done = subprocess.run([sys.executable, "-c", WORKER, str(repeats), str(threads), str(window)], cwd=root,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{root}: the worker failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per checkout, alternating")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats of each pass per process")
    parser.add_argument("--window", type=int, default=32768, help="bases of the scored eval window")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    sides = {"this": REPO, "baseline": args.baseline.resolve()}
    print(f"this: {REPO}\nbaseline: {sides['baseline']}\ntorch threads: {args.threads}; "
          f"{args.rounds} rounds x {args.repeats} timed repeats per checkout; eval window {args.window:,}")
    times = {side: {p: [] for p in PASSES} for side in sides}
    losses: dict = {}
    for _ in range(args.rounds):
        for side, root in sides.items():
            result = run_once(root, args.repeats, args.threads, args.window)
            for p in PASSES:
                times[side][p] += result[p]["times"]
                losses.setdefault(p, {})[side] = result[p]["loss"]
    print(f"{'pass':13s} {'baseline s':>11s} {'this s':>8s} {'ratio':>6s}  losses: baseline | this")
    for p in PASSES:
        base, this = statistics.median(times["baseline"][p]), statistics.median(times["this"][p])
        shown = " | ".join(", ".join(f"{x:.6f}" for x in losses[p][s]) for s in ("baseline", "this"))
        print(f"{p:13s} {base:11.3f} {this:8.3f} {base / this:6.2f}  {shown}")


if __name__ == "__main__":
    main()
