"""Speed of the k-pool indexer's token selection (``select_tokens``, torch path) with the top-k
block pre-filter against the same code with the pre-filter off (plain top-k over each row), on
one CPU thread, same inputs, same run; prints both timings and their ratio, and checks the two
selections are identical.

    .venv/bin/python benchmarks/bench_select_tokens.py --lengths 16k,64k --heads 4 --dim 16

Defaults are the tiny preset's indexer (4 heads x 16, kpool 4, top-k 256, query chunk 64).
"""

from __future__ import annotations

import argparse
import time

import torch

from genome_lm_kernels.dsa import indexer


def parse_length(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1], 1)
    return int(text.rstrip("km")) * scale


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="16k,64k")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--kpool", type=int, default=4)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'T':>9} {'plain top-k s':>14} {'pre-filter s':>13} {'ratio':>7} {'ns/pair':>8}  same")
    for T in (parse_length(x) for x in args.lengths.split(",")):
        g = torch.Generator().manual_seed(T)
        q = torch.randn(1, T, args.heads, args.dim, generator=g)
        k = torch.randn(1, T, args.dim, generator=g)
        w = torch.randn(1, T, args.heads, generator=g)
        kw = dict(kpool=args.kpool, topk=args.topk, chunk=args.chunk)
        block = indexer.BLOCK
        try:
            indexer.BLOCK = 1  # pre-filter off: every row through one top-k
            base_s, (base_idx, _) = timed(indexer.select_tokens, q, k, w, **kw)
        finally:
            indexer.BLOCK = block
        new_s, (new_idx, _) = timed(indexer.select_tokens, q, k, w, **kw)
        pairs = T * (T / args.kpool) / 2
        same = bool(torch.equal(base_idx, new_idx))
        print(f"{T:>9,} {base_s:>14.2f} {new_s:>13.2f} {base_s / new_s:>6.2f}x {new_s / pairs * 1e9:>8.1f}  {same}",
              flush=True)


if __name__ == "__main__":
    main()
