"""Evaluation throughput and memory: chunked prefill of one window of the tiny model on this CPU.

For each window length, a fresh process builds the tiny preset (seeded weights), warms up on
2k tokens, then scores one window of random DNA by chunked prefill (``genome_lm.model.prefill``,
the path `genome-lm eval --chunk` takes): tokens/s, peak resident memory, its growth over the
process's resident memory after the warm-up (the high-water mark is reset there, so start-up's
peak does not count), and the carried cache (KDA states, DSA latents and
pooled indexer keys). glibc's mmap threshold is fixed at 1 MiB (``BENCH_MMAP_THRESHOLD``) so
the RSS tracks live memory (at 64 KiB, every mid-sized tensor is a fresh mmap and the time
doubles; unset, freed blocks stay in a fragmented heap and the RSS drifts by tens of MiB). A length
whose run passes --timeout is reported as partial: the tokens scored by then and their rate
(an upper bound for the whole window: the indexer's work per query grows with the context).

    .venv/bin/python benchmarks/bench_eval.py --lengths 32k,128k,1M --chunk 8k --timeout 1800
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from genome_lm.measure import worker_env

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time, torch
from genome_lm.engine import quiet_megatron_import
from genome_lm.measure import reset_high_water, status_bytes
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model import get_preset
from genome_lm.model.model import build_model
from genome_lm.model.prefill import Prefill

length, chunk, threads, full = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.set_num_threads(threads)

def rss():  # resident high-water mark since the reset after the warm-up (not start-up's peak)
    return status_bytes("VmHWM")
with quiet_megatron_import(), parallel_context() as pg:
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()
    ids = torch.randint(4, 8, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        warm = Prefill(model)
        for s in range(0, 2048, 1024):
            warm(ids[:, s:s + 1024])
    del warm
    reset_high_water()  # VmHWM back to the current resident size
    base = status_bytes("VmRSS")
    print(json.dumps({"event": "start", "base_rss": base}), flush=True)
    t0 = time.perf_counter()
    if full:
        with torch.no_grad():
            logits = model(ids).logits
        nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        print(json.dumps({"event": "chunk", "done": length, "seconds": time.perf_counter() - t0}), flush=True)
        cache = 0
    else:
        prefill = Prefill(model, total_tokens=length)
        for s in range(0, length, chunk):
            logits = prefill(ids[:, s:s + chunk])
            targets = ids[0, s + 1:s + 1 + logits.shape[1]]
            torch.nn.functional.cross_entropy(logits[0, :targets.shape[0]].float(), targets, reduction="none")
            print(json.dumps({"event": "chunk", "done": min(s + chunk, length), "seconds": time.perf_counter() - t0,
                              "rss": rss()}), flush=True)
        cache = prefill.cache_bytes
    print(json.dumps({"event": "end", "seconds": time.perf_counter() - t0, "peak_rss": rss(), "base_rss": base,
                      "cache_bytes": cache}), flush=True)
"""


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def run_one(length: int, chunk: int, threads: int, timeout: float, full: bool) -> dict:
    env = worker_env(extra={"MALLOC_MMAP_THRESHOLD_": os.environ.get("BENCH_MMAP_THRESHOLD", "1048576")})
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(length), str(chunk), str(threads), "1" if full else "0"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    row = {"path": "full forward" if full else f"chunked {chunk:,}", "T": length, "status": "ok"}
    start = time.monotonic()
    last = None
    try:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            if event["event"] == "start":
                row["base_rss_mib"] = event["base_rss"] / 2**20
            elif event["event"] == "chunk":
                last = event
                print(f"  T={length:,}: {event['done']:,} tokens in {event['seconds']:.0f} s", file=sys.stderr,
                      flush=True)
            elif event["event"] == "end":
                row.update(seconds=event["seconds"], tokens_per_s=(length - 1) / event["seconds"],
                           peak_rss_mib=event["peak_rss"] / 2**20,
                           growth_mib=(event["peak_rss"] - event["base_rss"]) / 2**20,
                           cache_mib=event["cache_bytes"] / 2**20)
            if time.monotonic() - start > timeout:
                raise TimeoutError
        proc.wait()
        if "seconds" not in row:
            row["status"] = f"failed (exit {proc.returncode})"
    except TimeoutError:
        proc.kill()
        proc.wait()
        row["status"] = "partial (timeout)"
        if last is not None:
            row.update(seconds=last["seconds"], scored=last["done"], tokens_per_s=last["done"] / last["seconds"],
                       peak_rss_mib=last.get("rss", 0) / 2**20)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32k,128k,1M")
    parser.add_argument("--chunk", default="8k")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per length")
    parser.add_argument("--full", default="", help="lengths to also run as one full forward (e.g. 32k)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    chunk = parse_size(args.chunk)
    for text in args.lengths.split(","):
        rows.append(run_one(parse_size(text), chunk, args.threads, args.timeout, False))
    for text in filter(None, args.full.split(",")):
        rows.append(run_one(parse_size(text), chunk, args.threads, args.timeout, True))
    print(f"tiny preset, {args.threads} torch threads, random DNA, one window per row")
    header = (f"{'path':>16} {'T':>10} {'seconds':>9} {'tokens/s':>9} {'peak MiB':>9} {'growth MiB':>10} "
              f"{'cache MiB':>9}  status")
    print(header)
    for r in rows:
        cells = [f"{r.get(k):,.1f}" if isinstance(r.get(k), float) else "-"
                 for k in ("seconds", "tokens_per_s", "peak_rss_mib", "growth_mib", "cache_mib")]
        status = r["status"] + (f", {r['scored']:,} tokens scored" if "scored" in r else "")
        print(f"{r['path']:>16} {r['T']:>10,} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9} {cells[3]:>10} "
              f"{cells[4]:>9}  {status}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
