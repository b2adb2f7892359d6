"""How long `genome-lm --help` (and `genome-lm finetune --help`) take, this checkout against
another one in the same run: the command line must stay fast as the package grows.

Each checkout runs in fresh processes with only its own source on the path (PYTHONPATH = the
checkout and its kernels/ folder), alternating between the two so that machine noise hits both
alike; the median of --repeats runs is shown, with the ratio this / baseline.

    git worktree add /tmp/baseline <commit>
    .venv/bin/python benchmarks/bench_cli_startup.py --baseline /tmp/baseline --repeats 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = (["--help"], ["finetune", "--help"], ["eval", "--help"])


def run_once(root: Path, args: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "kernels")]))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "genome_lm", *args], cwd=root, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{root}: genome-lm {' '.join(args)} failed: {done.stderr.strip()[-300:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout (a git worktree)")
    parser.add_argument("--repeats", type=int, default=15)
    opts = parser.parse_args()
    print(f"{'command':<22} {'baseline s':>11} {'this s':>8} {'this / baseline':>16}")
    for args in COMMANDS:
        times: dict[Path, list[float]] = {opts.baseline: [], REPO: []}
        for _ in range(opts.repeats):
            for root in times:
                times[root].append(run_once(root, args))
        base, this = statistics.median(times[opts.baseline]), statistics.median(times[REPO])
        print(f"{' '.join(args):<22} {base:>11.3f} {this:>8.3f} {this / base:>16.2f}")


if __name__ == "__main__":
    main()
