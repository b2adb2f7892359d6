"""Context-length buckets and bootstrap intervals over windows.

Context of a scored base = the number of bases before it in its window (the tokens the model
saw when predicting it). The first base of a window has no prediction, so every scored base has
context >= 1; the base at window offset j has context j.

Buckets are half-open ``[edge[i], edge[i+1])`` over a sorted list of edges starting at 0. The
default edges are 0, then powers of two from 1k (1,024) below the window length, then the window
length: for a 512k window ``[0, 1k), [1k, 2k), ..., [256k, 512k)``; for 1M the last is
``[512k, 1M)``. Windows shorter than 2k start the powers at window / 8 (rounded down to a power
of two), so a short test window still gets several buckets.

Intervals: a percentile bootstrap over windows (tokens of one window are not independent). Each
resample draws the windows with replacement (multinomial counts, seeded numpy ``Generator``) and
takes the token-weighted mean of the drawn windows' tokens in the bucket; the interval is the
2.5th and 97.5th percentile of those means. A comparison of two models on the same tokens uses
the same resamples for both (paired), so the interval of the relative change reflects only how
the change varies between windows.

Overlapping windows (an evaluation split prepared with a stride below the window) score a base
several times, at different context lengths, so windows are no longer independent units: the
bootstrap then draws blocks of sequence instead (``bootstrap_units``): block b of a chromosome
holds every score of its bases [b * block, (b + 1) * block), whichever window scored them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from genome_lm.errors import GenomeLMError
from genome_lm.units import parse_size

from .schema import Span

DEFAULT_FIRST_EDGE = 1024


def default_edges(window: int) -> list[int]:
    """0, powers of two from 1k (or window / 8 for short windows) below ``window``, ``window``."""
    if window < 2:
        return [0, max(window, 1)]
    first = DEFAULT_FIRST_EDGE if window >= 2 * DEFAULT_FIRST_EDGE else 1 << max(0, (window // 8).bit_length() - 1)
    edges = [0]
    edge = first
    while edge < window:
        edges.append(edge)
        edge *= 2
    return edges + [window]


def parse_edges(text: str, window: int) -> list[int]:
    """``--buckets`` text -> edges. Comma-separated sizes (``0,1k,4k,64k``; a last edge below the
    window length is followed by the window length), or ``pow2:SIZE`` for 0 then powers of two
    from SIZE up to the window length."""

    text = text.strip()
    try:
        if text.startswith("pow2:"):
            first = parse_size(text[5:])
            if first & (first - 1):
                raise ValueError(f"{first} is not a power of two")
            edges = [0]
            edge = first
            while edge < window:
                edges.append(edge)
                edge *= 2
            edges.append(window)
        else:
            edges = [parse_size(x) if x.strip() not in ("0", "") else 0 for x in text.split(",") if x.strip()]
            if edges and edges[-1] < window:
                edges.append(window)
    except ValueError as exc:
        raise GenomeLMError(f"--buckets {text!r}: {exc}") from None
    if len(edges) < 2 or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise GenomeLMError(f"--buckets {text!r}: edges must start at 0 and increase (e.g. 0,1k,4k,64k or pow2:1k)")
    return edges


def bucket_of(context: np.ndarray, edges: list[int]) -> np.ndarray:
    """Bucket index of each context (-1 when outside [edges[0], edges[-1]))."""
    b = np.searchsorted(np.asarray(edges), context, side="right") - 1
    return np.where((context >= edges[0]) & (context < edges[-1]), b, -1)


@dataclass
class WindowSums:
    """Per-window sums of token losses and token counts per group: sums, counts [W, G]."""

    sums: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray, window: np.ndarray, group: np.ndarray, n_windows: int, n_groups: int):
        """values, window, group [N] (group -1: left out) -> per-window sums and counts."""
        keep = group >= 0
        flat = window[keep] * n_groups + group[keep]
        size = n_windows * n_groups
        sums = np.bincount(flat, weights=values[keep], minlength=size).reshape(n_windows, n_groups)
        counts = np.bincount(flat, minlength=size).reshape(n_windows, n_groups).astype(np.float64)
        return cls(sums, counts)

    def means(self) -> np.ndarray:
        tot = self.counts.sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tot > 0, self.sums.sum(0) / np.maximum(tot, 1), np.nan)


def window_units(scores) -> tuple[np.ndarray, int]:
    """(unit [N], count): each scored window one bootstrap unit, numbered in window order."""
    windows, unit = np.unique(scores.window, return_inverse=True)
    return unit, len(windows)


def bootstrap_units(scores, windows) -> tuple[np.ndarray, int, str]:
    """(unit [N] in 0..U-1, U, what a unit is) for the bootstrap of ``scores``
    (``score.TokenScores``; ``windows``: the split's windows, indexed by ``scores.window``, each
    with ``chrom``, ``start`` and ``length``). Windows that do not overlap are the units; when any
    two overlap, blocks of sequence are, one window length long (see the module docstring)."""
    used = np.unique(scores.window)
    spans = sorted((windows[i].chrom, windows[i].start, windows[i].start + windows[i].length) for i in used)
    overlap = any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:]))
    if not overlap:
        return *window_units(scores), "window"
    block = max(windows[i].length for i in used)
    chroms = {name: k for k, name in enumerate(sorted({windows[i].chrom for i in used}))}
    first = {name: min(windows[i].start for i in used if windows[i].chrom == name) for name in chroms}
    chrom_of = np.array([chroms.get(w.chrom, -1) for w in windows])
    # blocks from each chromosome's first scored base: those of a plain split's windows
    start_of = np.array([w.start - first.get(w.chrom, 0) for w in windows], dtype=np.int64)
    position = start_of[scores.window] + scores.context
    keys = chrom_of[scores.window].astype(np.int64) * (1 << 40) + position // block
    uniq, unit = np.unique(keys, return_inverse=True)
    return unit, len(uniq), f"block of {block:,} bases"


def units_text(report) -> str:
    """What the report's (``schema.EvalReport``) intervals are over: "windows", or "blocks of
    32,768 bases"."""
    unit = report.settings.bootstrap.unit
    return "windows" if unit == "window" else unit.replace("block", "blocks", 1)


def resample_weights(n_windows: int, resamples: int, seed: int) -> np.ndarray:
    """[R, W] how often each window is drawn in each bootstrap resample (seeded)."""
    rng = np.random.default_rng(seed)
    if n_windows == 0:
        return np.zeros((resamples, 0))
    return rng.multinomial(n_windows, np.full(n_windows, 1.0 / n_windows), size=resamples).astype(np.float64)


def _resampled_means(ws: WindowSums, weights: np.ndarray) -> np.ndarray:
    tot = weights @ ws.counts
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, (weights @ ws.sums) / np.maximum(tot, 1e-300), np.nan)  # [R, G]


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Per column of samples [R, G]: the (1-level)/2 and (1+level)/2 percentiles, ignoring NaN
    (a resample that drew no token of a group); NaN where every resample is NaN."""
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    out_lo = np.full(samples.shape[1], np.nan)
    out_hi = np.full(samples.shape[1], np.nan)
    for g in range(samples.shape[1]):
        col = samples[:, g]
        col = col[np.isfinite(col)]
        if col.size:
            out_lo[g], out_hi[g] = np.percentile(col, [lo, hi])
    return out_lo, out_hi


def mean_interval(ws: WindowSums, weights: np.ndarray, level: float = 0.95):
    """(means [G], low [G], high [G]): token-weighted means and their bootstrap interval."""
    lo, hi = percentile_interval(_resampled_means(ws, weights), level)
    return ws.means(), lo, hi


def change_interval(base: WindowSums, other: WindowSums, weights: np.ndarray, level: float = 0.95):
    """Relative change (other - base) / base per group on the same tokens, and its paired
    bootstrap interval: (change [G], low [G], high [G])."""
    mb, mo = base.means(), other.means()
    with np.errstate(invalid="ignore", divide="ignore"):
        change = (mo - mb) / mb
        rb, ro = _resampled_means(base, weights), _resampled_means(other, weights)
        lo, hi = percentile_interval((ro - rb) / rb, level)
    return change, lo, hi


def difference_interval(base: WindowSums, other: WindowSums, weights: np.ndarray, level: float = 0.95):
    """Difference of means other - base per group on the same tokens, and its paired bootstrap
    interval: (difference [G], low [G], high [G])."""
    difference = other.means() - base.means()
    lo, hi = percentile_interval(_resampled_means(other, weights) - _resampled_means(base, weights), level)
    return difference, lo, hi


def finite(x) -> float | None:
    """``x`` as a float, None when it is not finite (JSON has no NaN)."""
    x = float(x)
    return x if math.isfinite(x) else None


def subset_sums(scores, window_pos: np.ndarray, n_windows: int, keep: np.ndarray | None = None) -> WindowSums:
    """Per-window sums of ``scores`` (``score.TokenScores``) by subset (all, unmasked,
    soft-masked), over the tokens where ``keep`` is true (all when None)."""
    subset = np.where(scores.softmasked, 2, 1)
    whole = np.zeros_like(subset)
    if keep is not None:
        subset, whole = np.where(keep, subset, -1), np.where(keep, whole, -1)
    whole = WindowSums.of(scores.nll, window_pos, whole, n_windows, 1)
    parts = WindowSums.of(scores.nll, window_pos, subset, n_windows, 3)
    return WindowSums(np.concatenate([whole.sums, parts.sums[:, 1:]], 1),
                      np.concatenate([whole.counts, parts.counts[:, 1:]], 1))


def subset_and_bucket_sums(scores, window_pos: np.ndarray, n_windows: int, edges: list[int]):
    """Per-window sums of ``scores`` (``score.TokenScores``): by subset (all, unmasked,
    soft-masked) and by context bucket."""
    buckets = WindowSums.of(scores.nll, window_pos, bucket_of(scores.context, edges), n_windows, len(edges) - 1)
    return subset_sums(scores, window_pos, n_windows), buckets


def bucket_centres(buckets: list[Span]) -> np.ndarray:
    """Geometric centre of each [start, end) bucket (start 0 counts as 1), for a log axis."""
    return np.array([math.sqrt(max(b.start, 1) * max(b.end - 1, 1)) for b in buckets])


def errorbars(stats: list, key: str, ci_key: str, scale: float = 1.0):
    """(values, matplotlib yerr) of each stat's ``key`` field and its interval field ``ci_key``,
    times ``scale``."""
    values = [getattr(s, key) for s in stats]
    intervals = [getattr(s, ci_key) for s in stats]
    y = np.array([np.nan if v is None else v * scale for v in values])
    lo = np.array([np.nan if ci[0] is None else ci[0] * scale for ci in intervals])
    hi = np.array([np.nan if ci[1] is None else ci[1] * scale for ci in intervals])
    return y, np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
