"""``genome-lm bench kernels``: the sequence ops against their baselines on this CPU.

KDA: the chunked torch path (with the C recurrence where the backend runs it), the token-by-token
reference and transformers' glm5_next torch chunked KDA (``chunk_kimi_delta_attention``), forward
and forward+backward. Every measurement runs in a fresh process (``genome_lm.measure.run_fresh``),
so its peak is that process's own high-water mark above the inputs, and transformers runs with
fla hidden (``sys.modules["fla"] = None``; otherwise it swaps in fla's Triton kernels, which fail
on a CPU). All get the same inputs (glm5_next's safe gate, q/k L2-normalised inside the op).
Lengths beyond ``reference_max_len`` / ``transformers_max_len`` are not run: the row holds the
longest measured run scaled linearly in T (both are linear in T) and says "extrapolated".

DSA: the sparse path (``select_tokens`` with the k-pool indexer, then ``sparse_attention`` forward
and backward) against dense masked attention (plain torch with [B, H, T, T] scores, unselected
keys at -inf, the same selection as a mask), forward and backward, in this process: peak memory
is the resident growth during the step, sampled every 2 ms (``genome_lm.measure.SampledPeak``),
autograd's saved tensors included.
"""

from __future__ import annotations

import gc
import sys
import time

import torch

from genome_lm.measure import MeasurementError, Peak, SampledPeak, run_fresh, serve
from genome_lm_kernels import resolve_backend
from genome_lm_kernels.dsa import select_tokens, sparse_attention

IMPLS = ("torch", "reference", "transformers")


# ------------------------------------------------------------------------------------------ KDA
def kda_bench(
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
                    measured = _run_kda(dict(impl=impl, mode=mode, B=batch, T=run_T, H=heads, K=head_dim,
                                             V=head_dim, threads=threads), timeout_s)
                row = dict(measured)
                if row["T"] != T:  # linear in T: scale time and memory from the longest run
                    ratio = T / row["T"]
                    row.update(T=T, seconds=row["seconds"] * ratio, peak_mib=row["peak_mib"] * ratio,
                               note=f"extrapolated from T={measured['T']}")
                row["tokens_per_s"] = batch * T / row["seconds"]
                rows.append(row)
    return rows


def _run_kda(cfg: dict, timeout_s: int) -> dict:
    try:
        return run_fresh("genome_lm.compare.kernels", cfg, timeout=timeout_s)
    except (MeasurementError, TimeoutError) as err:
        return dict(cfg, seconds=float("nan"), peak_mib=float("nan"), note=f"failed: {str(err)[-300:]}")


def _measure_kda(cfg: dict) -> dict:
    """Worker body: build inputs, warm up on a short input, time one call; the row."""
    if cfg["impl"] == "transformers":
        sys.modules["fla"] = None  # type: ignore[assignment]  # before anything imports transformers
    import torch

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
    with Peak() as peak:
        call(inputs)
    return dict(cfg, seconds=peak.seconds, peak_mib=peak.bytes / 2**20, note="measured")


# ------------------------------------------------------------------------------------------ DSA
def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def dense_masked_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, *, scale: float):
    """Attention with dense [B, H, T, T] scores, unselected keys masked to -inf."""
    B, T = q_BTHD.shape[:2]
    mask_BTT = torch.zeros(B, T, T + 1, dtype=torch.bool)
    mask_BTT.scatter_(-1, torch.where(idx_BTS >= 0, idx_BTS, T), True)
    s_BHTT = torch.einsum("bthd,bshd->bhts", q_BTHD, k_BTHD) * scale
    s_BHTT = s_BHTT.masked_fill(~mask_BTT[:, None, :, :T], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s_BHTT.softmax(-1), v_BTHD)


def _dense_bytes(B, T, H) -> int:
    # scores, masked scores, probabilities and their gradient, fp32, plus the bool mask
    return 4 * B * H * T * T * 4 + B * T * T


def _inputs(T, B, H, D, Hi, Di, kpool, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    idx_in = dict(q_idx_BTHD=r(B, T, Hi, Di), k_idx_BTD=r(B, T, Di), w_idx_BTH=r(B, T, Hi),
                  gate_BTD=r(B, T, Di), ape_KD=r(kpool, Di))
    return idx_in, r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)


def _sparse_step(idx_in, q, k, v, do, *, kpool, topk, chunk):
    backend = resolve_backend("torch", q.device)
    t0 = time.perf_counter()
    idx, _ = select_tokens(**idx_in, kpool=kpool, topk=topk, backend=backend, chunk=chunk)
    t1 = time.perf_counter()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, _ = sparse_attention(q, k, v, idx, scale=q.shape[-1] ** -0.5, backend=backend, chunk=chunk)
    (o * do).sum().backward()
    return idx, t1 - t0, time.perf_counter() - t1


def dsa_bench(lengths=(8192, 32768, 131072), *, batch: int = 1, heads: int = 2, head_dim: int = 64,
          idx_heads: int = 2, idx_dim: int = 64, topk: int = 2048, kpool: int = 4, chunk: int = 64,
          dense_memory_fraction: float = 0.6, max_seconds: float = 240.0, threads: int | None = None,
          seed: int = 0) -> list[dict]:
    """One dict per (length, path): time (s) and peak memory growth (bytes, per token too).

    A row is run only when it should fit: dense needs ``_dense_bytes`` below
    ``dense_memory_fraction`` of MemAvailable, and a path whose time predicted from the previous
    length (T^2 for dense and the indexer, T for the gathered attention) exceeds ``max_seconds`` is
    not run. Rows not run have ``skipped`` with the reason and ``extrapolated`` times.
    ``threads`` sets torch's intra-op threads for the run (restored after): on a machine shared
    with other work, 1 thread avoids OpenMP barrier stalls that can cost milliseconds per op."""
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(lengths, batch, heads, head_dim, idx_heads, idx_dim, topk, kpool, chunk,
                      dense_memory_fraction, max_seconds, seed)
    finally:
        torch.set_num_threads(saved_threads)


def _bench(lengths, batch, heads, head_dim, idx_heads, idx_dim, topk, kpool, chunk, dense_memory_fraction,
           max_seconds, seed):
    rows: list[dict] = []
    last = {"sparse": None, "dense": None}
    for T in lengths:
        idx_in, q, k, v, do = _inputs(T, batch, heads, head_dim, idx_heads, idx_dim, kpool, seed)
        common = dict(T=T, threads=torch.get_num_threads(), batch=batch, heads=heads, head_dim=head_dim,
                      idx_heads=idx_heads, idx_dim=idx_dim, topk=topk, kpool=kpool, chunk=chunk)
        idx = None
        prev = last["sparse"]
        # The indexer scores T^2 / kpool pairs; the torch attention gathers each query's own
        # S keys, so its time is linear in T.
        pred = None if prev is None else (prev["select_s"] * (T / prev["T"]) ** 2
                                          + prev["attention_s"] * T / prev["T"])
        if pred is not None and pred > max_seconds:
            rows.append(dict(common, path="sparse", skipped=f"predicted {pred:.0f} s > max_seconds",
                             extrapolated=True, time_s=pred, peak_bytes=None, bytes_per_token=None))
        else:
            gc.collect()
            with SampledPeak() as m:
                idx, sel_s, attn_s = _sparse_step(idx_in, q, k, v, do, kpool=kpool, topk=topk, chunk=chunk)
            row = dict(common, path="sparse", skipped=None, extrapolated=False, time_s=sel_s + attn_s,
                       select_s=sel_s, attention_s=attn_s, peak_bytes=m.delta, bytes_per_token=m.delta / (batch * T))
            rows.append(row)
            last["sparse"] = row
            q, k, v = (x.detach() for x in (q, k, v))

        need = _dense_bytes(batch, T, heads)
        prev = last["dense"]
        pred = None if prev is None else prev["time_s"] * (T / prev["T"]) ** 2
        reason = None
        if need > dense_memory_fraction * _available_bytes():
            reason = f"needs about {need / 2**30:.1f} GiB for [B, H, T, T] tensors, more than fits here"
        elif pred is not None and pred > max_seconds:
            reason = f"predicted {pred:.0f} s > max_seconds"
        elif idx is None:
            reason = "no selection (sparse row skipped)"
        if reason:
            rows.append(dict(common, path="dense", skipped=reason, extrapolated=pred is not None, time_s=pred,
                             peak_bytes=need, bytes_per_token=need / (batch * T), peak_is_estimate=True))
            continue
        gc.collect()
        qd, kd, vd = (x.clone().requires_grad_() for x in (q, k, v))
        with SampledPeak() as m:
            t0 = time.perf_counter()
            (dense_masked_attention(qd, kd, vd, idx, scale=head_dim**-0.5) * do).sum().backward()
            dt = time.perf_counter() - t0
        row = dict(common, path="dense", skipped=None, extrapolated=False, time_s=dt, peak_bytes=m.delta,
                   bytes_per_token=m.delta / (batch * T))
        rows.append(row)
        last["dense"] = row
        del qd, kd, vd
    return rows


if __name__ == "__main__":
    serve(_measure_kda)
