"""Time and peak memory of KDA on this CPU: the chunked torch path, the token-by-token
reference and transformers' glm5_next torch chunked KDA (``chunk_kimi_delta_attention``).

Every measurement runs in a fresh subprocess, so peak memory is that process's own high-water
mark (Linux VmHWM, reset after the inputs exist) and transformers can run with fla hidden
(``sys.modules["fla"] = None``; otherwise it swaps in fla's Triton kernels, which fail on CPU).
All three get the same inputs (glm5_next's safe gate, q/k L2-normalised inside the op).

Lengths beyond ``reference_max_len`` / ``transformers_max_len`` are not run: the row holds the
longest measured run scaled linearly in T (both are linear in T) and says "extrapolated".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

IMPLS = ("torch", "reference", "transformers")


def bench(
    lengths: tuple[int, ...] = (8192, 32768, 131072),
    *,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    backward: bool = False,
    reference_max_len: int = 32768,
    transformers_max_len: int = 32768,
    threads: int | None = 1,
    timeout_s: int = 600,
) -> list[dict]:
    """One row per (implementation, length): forward time, and forward+backward for the torch
    path and the reference when ``backward`` (transformers: forward only; the reference's
    backward runs at most 8,192 tokens). transformers' chunked KDA holds [T, 64, K] decay tensors
    (several GB at 32k tokens), hence its lower default cap.

    Row keys: impl, mode, B, T, H, K, V, seconds, peak_mib (above the inputs), tokens_per_s,
    note ("measured" or "extrapolated from T=..."). ``threads``: torch threads in each
    subprocess; default 1, because on a busy 2-core machine OpenMP's spinning threads made the
    loop-heavy paths 5-50x slower and the numbers meaningless (None: torch's own choice).
    """
    rows = []
    for impl in IMPLS:
        modes = ["forward"] + (["forward+backward"] if backward and impl != "transformers" else [])
        for mode in modes:
            cap = {"torch": max(lengths), "reference": reference_max_len, "transformers": transformers_max_len}[impl]
            if impl == "reference" and mode != "forward":
                cap = min(cap, 8192)  # autograd through the loop: ~1 min and 2.5 GB at 8k, H=4, d=64
            measured: dict | None = None
            for T in sorted(lengths):
                if T <= cap or measured is None:
                    run_T = min(T, cap)
                    measured = _run_worker(dict(impl=impl, mode=mode, B=batch, T=run_T, H=heads, K=head_dim,
                                                V=head_dim, threads=threads), timeout_s)
                row = dict(measured)
                if row["T"] != T:  # linear in T: scale time and memory from the longest run
                    ratio = T / row["T"]
                    row.update(T=T, seconds=row["seconds"] * ratio, peak_mib=row["peak_mib"] * ratio,
                               note=f"extrapolated from T={measured['T']}")
                row["tokens_per_s"] = batch * T / row["seconds"]
                rows.append(row)
    return rows


def _run_worker(cfg: dict, timeout_s: int) -> dict:
    code = f"from genome_lm_kernels.kda.bench import _measure; _measure({json.dumps(cfg)!r})"
    env = dict(os.environ)
    if cfg["impl"] == "transformers":
        code = 'import sys; sys.modules["fla"] = None\n' + code
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        return dict(cfg, seconds=float("nan"), peak_mib=float("nan"), note=f"failed: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure(cfg_json: str) -> None:
    """Subprocess body: build inputs, warm up on a short input, time one call, print a JSON row."""
    import torch

    cfg = json.loads(cfg_json)
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    B, T, H, K, V = (cfg[n] for n in "BTHKV")
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    inputs = [q, k, v, g, beta]

    if cfg["impl"] == "transformers":
        from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention

        def op(q, k, v, g, beta):
            return chunk_kimi_delta_attention(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        from genome_lm_kernels import resolve_backend
        from genome_lm_kernels.kda import kda

        backend = resolve_backend(cfg["impl"], q.device)

        def op(q, k, v, g, beta):
            return kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True, backend=backend)

    backward = cfg["mode"] == "forward+backward"

    def call(xs):
        if not backward:
            with torch.no_grad():
                return op(*xs)
        xs = [x.requires_grad_() for x in xs]
        o, S = op(*xs)
        torch.autograd.grad((o.sum(), S.sum()), xs)

    call([x[:, :64].clone() for x in inputs])  # first-call set-up (thread pools, MKL) off the clock
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _rss_mib("VmRSS")
    start = time.perf_counter()
    call(inputs)
    seconds = time.perf_counter() - start
    peak = _rss_mib("VmHWM") - base
    print(json.dumps(dict(cfg, seconds=seconds, peak_mib=max(peak, 0.0), note="measured")))
