"""Does torch.compile (inductor, C++ on this CPU) speed up the tiny model's hot pieces? Eager
against compiled in the same process, forward + backward, with the compile time and the ratio.

Pieces: the mHC Sinkhorn normalisation's steps and recomputing gradient
(``genome_lm_kernels.mhc.recompute.steps`` / ``grad``, what ``model.compile``
compiles), KDA's per-chunk preparation (``genome_lm_kernels.kda.chunked._chunk_prepare``, the
pairwise decays, the UT transform and the WY pair for a group of chunks) and one mHC
hyper-connection with its merge (``genome_lm.model.common.HyperConnection``), at the long
recipe's two step shapes. A piece is worth compiling in genome-lm only if the ratio is well above
1 and the compile time is small against a run.

    .venv/bin/python benchmarks/bench_compile_cpu.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kda_prepare_case(N: int):
    from genome_lm_kernels.kda import chunked

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(N, 64, 16, generator=gen).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(N, 64, 16, generator=gen), dim=-1).requires_grad_()
    v = torch.randn(N, 64, 16, generator=gen).requires_grad_()
    G = (-0.5 * torch.rand(N, 64, 16, generator=gen)).double().cumsum(1).requires_grad_()
    beta = torch.rand(N, 64, generator=gen).requires_grad_()

    def make(fn):
        def step():
            outs = fn(q, k, v, G, beta)
            torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
        return step

    return chunked._chunk_prepare, make


def sinkhorn_case(M: int):
    from genome_lm_kernels.mhc import recompute

    gen = torch.Generator().manual_seed(0)
    z, g = torch.randn(4, 4, M, generator=gen), torch.randn(4, 4, M, generator=gen)

    def pieces(z, g):
        return recompute.steps(z, 20, 1e-6), recompute.grad(z, g, 20, 1e-6)

    def make(fn):
        return lambda: fn(z, g)

    return pieces, make


def hyper_connection_case(S: int, B: int):
    from genome_lm.model.common import HyperConnection
    from genome_lm.model.presets import get_preset

    torch.manual_seed(0)
    from genome_lm_kernels import resolve_backend

    hc = HyperConnection(get_preset("tiny-long"), resolve_backend("torch", "cpu"))
    x = torch.randn(S, B, 4, 64, requires_grad=True)
    block_out = torch.randn(S, B, 64, requires_grad=True)

    def piece(x, block_out):
        post, comb, block_in = hc(x)
        return hc.merge(post, comb, block_out, x), block_in

    def make(fn):
        def step():
            outs = fn(x, block_out)
            torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
        return step

    return piece, make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cases = {
        "mHC Sinkhorn steps + gradient, 2,048 tokens (stage 1)": sinkhorn_case(2048),
        "mHC Sinkhorn steps + gradient, 8,192 tokens (stage 2)": sinkhorn_case(8192),
        "KDA prepare, 128 chunks (stage 2, 8k x 4 heads / 4 groups)": kda_prepare_case(128),
        "mHC + merge, 8 x 256 tokens (stage 1)": hyper_connection_case(256, 8),
        "mHC + merge, 8,192 tokens (stage 2)": hyper_connection_case(8192, 1),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}")
    print(f"{'piece':60s} {'eager ms':>9s} {'compiled ms':>12s} {'ratio':>6s} {'compile s':>10s}")
    for name, (fn, make) in cases.items():
        eager = timed(make(fn), args.repeats)
        compiled_fn = torch.compile(fn, dynamic=True)
        start = time.perf_counter()
        make(compiled_fn)()  # compiles forward and backward
        compile_s = time.perf_counter() - start
        compiled = timed(make(compiled_fn), args.repeats)
        print(f"{name:60s} {eager * 1e3:9.2f} {compiled * 1e3:12.2f} {eager / compiled:6.2f} {compile_s:10.1f}")


if __name__ == "__main__":
    main()
