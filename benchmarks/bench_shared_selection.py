"""The DSA selection and indexer loss shared out over the context-parallel ranks
(``parallel.split_dsa_selection``) against every rank doing the whole sequence (the published
layout), in the same run: two gloo ranks (CP 2, one thread each), the shipped tiny-long model,
a forward and backward with the sparse indexer loss on one sequence; prints each setting's
median step time over the repeats and the ratio, and checks both give the same loss.

    .venv/bin/python benchmarks/bench_shared_selection.py --length 32k --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_length(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1], 1)
    return int(text.rstrip("km")) * scale


def worker(rank: int, world: int, port: int, spec: dict) -> None:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch

    from genome_lm.engine.context_parallel import zigzag_split
    from genome_lm.engine.parallel import ParallelSizes, init_distributed, parallel_context
    from genome_lm.model.model import build_model
    from genome_lm.model.presets import get_preset
    from genome_lm.weights import resolve

    torch.set_num_threads(1)
    init_distributed(rank, world, init_method=f"tcp://127.0.0.1:{port}")
    sizes = ParallelSizes(cp=world, split_dsa_selection=spec["split"])
    with parallel_context(sizes) as pg:
        from genome_lm.checkpoint.huggingface import load_hf_checkpoint

        model = build_model(get_preset("tiny-long"), pg, sizes, kernel_backend="torch")
        load_hf_checkpoint(model, resolve("builtin:tiny-long"))
        ids = torch.randint(4, 8, (1, spec["length"] + 1), generator=torch.Generator().manual_seed(0))
        inputs = zigzag_split(ids[:, :-1], world, pg.cp.rank())
        times, loss = [], None
        for _ in range(spec["repeats"] + 1):  # the first is a warm-up
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out = model(inputs, indexer_loss="sparse")
            total = sum(out.indexer_losses) + out.logits.float().mean()
            total.backward()
            torch.distributed.barrier()
            times.append(time.perf_counter() - t0)
            loss = float(sum(out.indexer_losses).detach())
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps({"times": times[1:], "indexer_loss": loss}))


def run(split: bool, length: int, repeats: int, out: Path) -> dict:
    from genome_lm.engine.parallel import free_port

    port = free_port()
    spec = json.dumps({"split": split, "length": length, "repeats": repeats, "out": str(out)})
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "2", str(port), spec]) for r in range(2)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank failed (split={split})")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", default="32k", help="tokens of the sequence (divisible by 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, world, port, spec = args.worker
        worker(int(rank), int(world), int(port), json.loads(spec))
        return
    import tempfile

    length = parse_length(args.length)
    with tempfile.TemporaryDirectory() as tmp:
        whole = run(False, length, args.repeats, Path(tmp) / "whole.json")
        shared = run(True, length, args.repeats, Path(tmp) / "shared.json")
    a, b = statistics.median(whole["times"]), statistics.median(shared["times"])
    print(f"tiny-long, {length:,} tokens, CP 2 (2 gloo ranks, 1 thread each), forward + backward with the sparse "
          f"indexer loss, median of {args.repeats}:")
    print(f"  every rank the whole selection (published layout): {a:.2f} s")
    print(f"  selection shared out (genome-lm):                  {b:.2f} s")
    print(f"  ratio: x{a / b:.2f} faster; indexer loss {whole['indexer_loss']:.6f} vs {shared['indexer_loss']:.6f}")
    if abs(whole["indexer_loss"] - shared["indexer_loss"]) > 1e-5 * max(1.0, abs(whole["indexer_loss"])):
        raise SystemExit("the two layouts gave different indexer losses")


if __name__ == "__main__":
    main()
