"""Training memory on this CPU: one forward+backward step of the tiny model per (setting, length).

For each memory setting (plain, full recompute, offload, recompute+offload+MoE chunks) the step
runs in a fresh worker process at growing lengths until it exceeds ``--limit-gib`` of resident
memory (the worker is killed at the limit) or ``--max-seconds``; the table gives peak RSS above
the built model, step time and tokens/s side by side, and the cost of each setting relative to
the plain step at the same length. Optionally draws tokens/s and peak memory against length.

    .venv/bin/python benchmarks/bench_train_memory.py --lengths 32k,64k,128k --png /tmp/mem.png
    .venv/bin/python benchmarks/bench_train_memory.py --lengths 1M --settings recompute+offload
    .venv/bin/python benchmarks/bench_train_memory.py --lengths 32k --settings all-reselect,all --baseline all-reselect

Not a test: it takes minutes to hours. Offload on a CPU moves nothing off a device, so its cost
here is the extra copies only; on a GPU it is what frees device memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {
    "plain": {},
    "recompute": {"recompute": "full"},
    "offload": {"offload_activations": True},
    "recompute+offload": {"recompute": "full", "offload_activations": True, "moe_chunks": 8},
    # query chunk as in the shipped configs (65536 scored 65,536 queries against every pool at
    # once and was OOM-killed at 128k)
    "all": {"recompute": "full", "recompute_nested": True, "offload_activations": True, "moe_chunks": 8,
            "dsa_query_chunk": 1024},
    # "all", but the recomputed DSA layers run the indexer again instead of replaying the selection
    "all-reselect": {"recompute": "full", "recompute_nested": True, "offload_activations": True, "moe_chunks": 8,
                     "dsa_query_chunk": 1024, "dsa_keep_selection": False},
}


def _status(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def worker(args: dict) -> None:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch

    from genome_lm.config import MemoryConfig
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model
    from genome_lm.train.loss import lm_loss
    from genome_lm.train.memory import apply_memory, offload_saved_tensors

    torch.set_num_threads(args["threads"])
    settings = SETTINGS[args["setting"]]
    offload = settings.get("offload_activations", False)
    memory = MemoryConfig(**{k: v for k, v in settings.items() if k != "offload_activations"})
    T = args["T"]
    with parallel_context() as pg:
        torch.manual_seed(0)
        model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch")
        apply_memory(model, memory)
        ids = torch.randint(4, 8, (1, T + 1))
        weights = torch.ones(1, T)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status(os.getpid(), "VmRSS")
        t0 = time.perf_counter()
        with offload_saved_tensors(offload, pinned=False):
            out = model(ids[:, :-1], indexer_loss="sparse")
            parts = lm_loss(out.logits, ids[:, 1:], weights, global_weight=weights.sum(),
                            indexer_losses=out.indexer_losses)
            parts.total.backward()
        seconds = time.perf_counter() - t0
        peak = _status(os.getpid(), "VmHWM") - base
    print(json.dumps({"seconds": seconds, "peak_bytes": peak, "loss": float(parts.lm)}))


def run(setting: str, T: int, threads: int, limit: int, max_seconds: float) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps({"setting": setting, "T": T, "threads": threads})]
    # glibc serves large blocks from mmap only up to a threshold it raises as blocks are freed; freed
    # heap memory then stays resident and RSS no longer tells live memory (full recompute measured
    # x1.06 of plain with the default, x0.33 with this). A fixed threshold returns freed blocks.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    start, note = time.time(), None
    while proc.poll() is None:
        if _status(proc.pid, "VmRSS") > limit:
            note = f"over {limit / 2**30:.0f} GiB"
        elif time.time() - start > max_seconds:
            note = f"over {max_seconds:.0f} s"
        if note:
            proc.kill()
            proc.wait()
            return {"setting": setting, "T": T, "note": note}
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"setting": setting, "T": T, "note": "failed: " + err.strip().splitlines()[-1][:100]}
    row = json.loads(out.strip().splitlines()[-1])
    return {"setting": setting, "T": T, **row, "tokens_per_s": T / row["seconds"]}


def main() -> None:
    from genome_lm.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32k,64k,128k,256k")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=22.0)
    ap.add_argument("--max-seconds", type=float, default=1800)
    ap.add_argument("--baseline", default="plain", help="the setting the others are compared with")
    ap.add_argument("--json")
    ap.add_argument("--png")
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return
    rows = []
    for setting in a.settings.split(","):
        for T in (parse_size(x) for x in a.lengths.split(",")):
            row = run(setting, T, a.threads, int(a.limit_gib * 2**30), a.max_seconds)
            rows.append(row)
            base = next((r for r in rows if r["setting"] == a.baseline and r["T"] == T and "seconds" in r), None)
            if "seconds" in row:
                ratio = ""
                if base and setting != a.baseline:
                    ratio = (f"  time x{row['seconds'] / base['seconds']:.2f}, "
                             f"memory x{row['peak_bytes'] / base['peak_bytes']:.2f} of {a.baseline}")
                print(f"{setting:18s} T={T:>9,}: {row['seconds']:8.1f} s  {row['tokens_per_s']:8,.0f} tok/s  "
                      f"peak {row['peak_bytes'] / 2**30:6.2f} GiB{ratio}", flush=True)
            else:
                print(f"{setting:18s} T={T:>9,}: {row['note']}", flush=True)
                break  # longer lengths of this setting will not fit either
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for setting in dict.fromkeys(r["setting"] for r in rows):
            done = [r for r in rows if r["setting"] == setting and "seconds" in r]
            ax1.plot([r["T"] for r in done], [r["tokens_per_s"] for r in done], marker="o", label=setting)
            ax2.plot([r["T"] for r in done], [r["peak_bytes"] / 2**30 for r in done], marker="o", label=setting)
        for ax, label in ((ax1, "tokens/s"), (ax2, "peak RSS above the model (GiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel(label)
            ax.legend()
        fig.suptitle("tiny preset, one forward+backward step, this CPU")
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)


if __name__ == "__main__":
    main()
