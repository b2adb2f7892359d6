"""CPU benchmark: sparse DSA path vs dense masked attention, forward + backward.

sparse: ``select_tokens`` (k-pool indexer) + ``sparse_attention`` forward and backward (torch).
dense:  plain torch attention that materialises [B, H, T, T] scores and sets unselected keys to
        -inf (same selection, built into a [B, T, T] mask), forward and backward by autograd.
Peak memory is the growth of the process's resident set during the step, sampled from /proc
(torch's CPU allocator is invisible to tracemalloc); it includes autograd's saved tensors.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import torch

from .. import resolve_backend
from . import select_tokens, sparse_attention


class PeakRSS:
    """Peak resident-memory growth (bytes, ``.delta``) over a ``with`` block, sampled every 2 ms."""

    def __enter__(self):
        self.base = self.peak = self.rss()
        self._stop = False
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.delta = max(self.peak, self.rss()) - self.base

    def _poll(self):
        while not self._stop:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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


def bench(lengths=(8192, 32768, 131072), *, batch: int = 1, heads: int = 2, head_dim: int = 64,
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
            with PeakRSS() as m:
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
        with PeakRSS() as m:
            t0 = time.perf_counter()
            (dense_masked_attention(qd, kd, vd, idx, scale=head_dim**-0.5) * do).sum().backward()
            dt = time.perf_counter() - t0
        row = dict(common, path="dense", skipped=None, extrapolated=False, time_s=dt, peak_bytes=m.delta,
                   bytes_per_token=m.delta / (batch * T))
        rows.append(row)
        last["dense"] = row
        del qd, kd, vd
    return rows
