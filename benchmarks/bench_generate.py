"""`genome-lm generate`'s cost per generated base against the prompt's length, and against
re-running the whole forward for every new base; with --continuation, the repeat-continuation
table (``eval.probes.continuation``) of the shipped long-context model.

For each prompt length (random bases) the prompt is prefilled once and ``--new`` bases are
generated greedily; the table gives the prefill's seconds and the milliseconds per generated base
(the median of three runs, the lengths taken in turn), with the ratio to the shortest prompt's:
flat means the cache keeps a base's cost independent of the prompt. The last column is what one
base costs without the cache (a full forward over prompt + 1 token), and how many times slower.

    .venv/bin/python benchmarks/bench_generate.py --lengths 1k,4k,16k,64k,256k --new 64
    .venv/bin/python benchmarks/bench_generate.py --continuation --distances 1k,2k,4k,8k,16k,30k --trials 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def cost(lengths: list[int], new: int, repeats: int) -> None:
    from genome_lm.data.tokenizer import BASE_TOKENS
    from genome_lm.engine.parallel import parallel_context
    from genome_lm.eval.generate import Sampling, generate_batch
    from genome_lm.eval.models import load_model
    from genome_lm.model.prefill import chunked_logits

    rng = np.random.default_rng(0)
    prompts = {n: rng.choice(np.array(BASE_TOKENS), n).astype(np.uint8) for n in lengths}
    per_base = {n: [] for n in lengths}
    prefill_s = {n: [] for n in lengths}
    with parallel_context() as pg:
        model = load_model("builtin:tiny-long", pg).model.eval()
        generate_batch(model, [prompts[lengths[0]][:256]], Sampling(4, greedy=True))  # warm up
        for _ in range(repeats):
            for n in lengths:
                timing = {}

                def on_token(_k, timing=timing):
                    timing.setdefault("first", time.perf_counter())

                start = time.perf_counter()
                generate_batch(model, [prompts[n]], Sampling(new, greedy=True), on_token=on_token)
                end = time.perf_counter()
                prefill_s[n].append(timing["first"] - start)
                per_base[n].append((end - timing["first"]) / (new - 1))
        full = {}
        for n in lengths:  # one base without a cache: the whole prompt + 1 through the model
            ids = torch.from_numpy(np.append(prompts[n], BASE_TOKENS[0]).astype(np.int64))[None]
            start = time.perf_counter()
            with torch.no_grad():
                for _ in chunked_logits(model, ids, 32_768):
                    pass
            full[n] = time.perf_counter() - start
    first = statistics.median(per_base[lengths[0]])
    print(f"builtin:tiny-long, {torch.get_num_threads()} threads, {new} bases generated greedily, median of {repeats}")
    print(f"{'prompt':>8} {'prefill s':>10} {'ms / base':>10} {'/ shortest':>11} {'no cache, ms / base':>20} "
          f"{'x slower':>9}")
    for n in lengths:
        ms = statistics.median(per_base[n]) * 1e3
        print(f"{n:>8,} {statistics.median(prefill_s[n]):>10.2f} {ms:>10.2f} {ms / (first * 1e3):>11.2f} "
              f"{full[n] * 1e3:>20,.0f} {full[n] * 1e3 / ms:>9,.0f}")


def continuation(distances: list[int], trials: int, segment: int, cue: int) -> None:
    from genome_lm.engine.parallel import parallel_context
    from genome_lm.eval.models import load_model
    from genome_lm.eval.probes.continuation import continuation_probe
    from genome_lm.eval.probes.recall import SequencePool

    pool = SequencePool.random(4 << 20, seed=0)
    print(f"builtin:tiny-long: greedy continuation of a {segment}-base repeat from a {cue}-base cue, {trials} trials "
          "(identity with the repeat, 95% CI)")
    print(f"{'distance':>9} {'with the first copy':>26} {'without (control)':>26}")
    start = time.perf_counter()
    with parallel_context() as pg:
        model = load_model("builtin:tiny-long", pg).model.eval()
        continuation_probe(model, pool, distances, segment=segment, cue=cue, trials=trials, on_row=lambda r: print(
            f"{r.distance:>9,} {r.repeat:>8.3f} [{r.repeat_ci[0]:.3f}, {r.repeat_ci[1]:.3f}] "
            f"{r.control:>10.3f} [{r.control_ci[0]:.3f}, {r.control_ci[1]:.3f}]", flush=True))
    print(f"{time.perf_counter() - start:.0f} s")


def main() -> None:
    from genome_lm.units import parse_sizes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1k,4k,16k,64k,256k")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--continuation", action="store_true")
    parser.add_argument("--distances", default="1k,2k,4k,8k,16k,30k")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--segment", type=int, default=256)
    parser.add_argument("--cue", type=int, default=32)
    opts = parser.parse_args()
    if opts.continuation:
        continuation(parse_sizes(opts.distances), opts.trials, opts.segment, opts.cue)
    else:
        cost(parse_sizes(opts.lengths), opts.new, opts.repeats)


if __name__ == "__main__":
    main()
