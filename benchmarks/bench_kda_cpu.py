"""Speed of KDA's torch path on this CPU: the hand-written backward (``kda_chunked``) against
autograd through the same forward with the preparation checkpointed (``kda_chunked_autograd``),
same inputs, same run, interleaved; prints the minimum over the repeats of the forward (with
autograd recording) and of forward + backward, the ratios, and the largest relative difference
between the two paths' gradients.

    .venv/bin/python benchmarks/bench_kda_cpu.py --shapes 1x4096x4x16,1x4096x2x32 --threads 2

A shape is B x T x H x K (V = K); the default is the tiny model's KDA layer at the demo's
training length (one micro-batch of 4,096 tokens, 4 heads of 16), a 16k-token one and 2 heads
of 32. Inputs as the layer makes them: q and k of unit length, g = -5 sigmoid(x), beta =
sigmoid(x); random cotangents for o and the final state.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from genome_lm_kernels.kda.chunked import kda_chunked, kda_chunked_autograd

PATHS = {"autograd": kda_chunked_autograd, "hand-written": kda_chunked}


def make_inputs(B: int, T: int, H: int, K: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    return inputs, torch.randn(B, T, H, K, generator=gen), torch.randn(B, H, K, K, generator=gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x4096x4x16,1x16384x4x16,1x4096x2x32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, min of {args.repeats} (interleaved)")
    print(f"{'B x T x H x K':>16} {'path':>13} {'forward ms':>11} {'fwd+bwd ms':>11} {'bwd ms':>8}")
    for shape in args.shapes.split(","):
        B, T, H, K = (int(x) for x in shape.split("x"))
        bench_shape(shape, *make_inputs(B, T, H, K), K**-0.5, args.repeats)


def bench_shape(shape: str, inputs: list, w_o: torch.Tensor, w_S: torch.Tensor, scale: float, repeats: int) -> None:
    def forward(fn):
        return fn(*inputs, scale)

    def forward_backward(fn):
        o, S = forward(fn)
        return torch.autograd.grad((o * w_o).sum() + (S * w_S).sum(), inputs)

    grads = {name: forward_backward(fn) for name, fn in PATHS.items()}  # also the warm-up
    times = {(name, kind): [] for name in PATHS for kind in ("fwd", "fb")}
    for _ in range(repeats):
        for name, fn in PATHS.items():
            for kind, step in (("fwd", forward), ("fb", forward_backward)):
                start = time.perf_counter()
                step(fn)
                times[name, kind].append(time.perf_counter() - start)
    best = {key: min(ts) * 1e3 for key, ts in times.items()}
    for name in PATHS:
        fwd, fb = best[name, "fwd"], best[name, "fb"]
        print(f"{shape:>16} {name:>13} {fwd:11.1f} {fb:11.1f} {fb - fwd:8.1f}")
    diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads["hand-written"], grads["autograd"]))
    ratio = {kind: best["autograd", kind] / best["hand-written", kind] for kind in ("fwd", "fb")}
    print(f"{'':>16} {'ratio':>13} {ratio['fwd']:11.2f} {ratio['fb']:11.2f}"
          f"   (autograd / hand-written; gradients differ by {diff:.1e} relative)")

if __name__ == "__main__":
    main()
