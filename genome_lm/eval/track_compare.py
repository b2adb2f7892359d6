"""Two ``score`` runs of the same bases, base by base (``genome-lm compare-tracks``): how much one
model's log-likelihood of the reference beats another's, overall, on soft-masked (repeat) and
unmasked bases, and by the context the base was scored with.

The gain of a group is the mean over its bases of ``loglik(a) - loglik(b)`` (nats/base; above zero:
``a`` predicts the reference better), with the share of bases where ``a`` is better. Neighbouring
bases are not independent, so the 95% interval is a block bootstrap: the region is cut into blocks
of ``block`` bases, and each resample draws as many blocks as there are, with replacement.
Both runs must have scored the same bases with the same context (the same regions, window and
context); bases whose reference is N are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from genome_lm.errors import GenomeLMError

CONTEXT_EDGES = (0, *(1024 << k for k in range(11)), 1 << 40)  # 0, 1k, 2k, 4k, ... 1M, beyond


@dataclass
class GroupGain:
    name: str
    bases: int
    gain: float  # nats/base, a - b
    ci: tuple[float, float]
    better: float  # share of bases where a's log-likelihood is higher


def _read(folder: Path):
    path = Path(folder) / "tracks.parquet"
    if not path.is_file():
        raise GenomeLMError(f"{path}: missing (genome-lm score --out {folder} writes it)")
    return pq.read_table(path, columns=["chrom", "pos", "ref", "loglik", "context"])


def _label(lo: int, hi: int) -> str:
    def k(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 else str(n)

    return f"context {k(lo)}+" if hi >= 1 << 40 else f"context {k(lo)}-{k(hi)}"


def compare_tracks(a: Path, b: Path, *, block: int = 10_000, resamples: int = 1000, seed: int = 0,
                   edges: tuple[int, ...] = CONTEXT_EDGES) -> list[GroupGain]:
    """The gain of ``a``'s log-likelihood over ``b``'s per group (module docstring)."""
    ta, tb = _read(a), _read(b)
    if ta.num_rows != tb.num_rows or not (ta.column("chrom").equals(tb.column("chrom"))
                                          and ta.column("pos").equals(tb.column("pos"))):
        raise GenomeLMError(f"{a} and {b}: not the same bases (score the same regions with both models)")
    context = ta.column("context").to_numpy()
    if not np.array_equal(context, tb.column("context").to_numpy()):
        raise GenomeLMError(f"{a} and {b}: the bases were scored with other contexts (use the same --window and "
                            "--context)")
    la = ta.column("loglik").to_numpy(zero_copy_only=False).astype(np.float64)
    lb = tb.column("loglik").to_numpy(zero_copy_only=False).astype(np.float64)
    keep = ~(np.isnan(la) | np.isnan(lb))
    diff = (la - lb)[keep]
    masked = np.char.islower(np.array(ta.column("ref").to_pylist()))[keep]
    context = context[keep]
    chrom = ta.column("chrom").to_numpy(zero_copy_only=False)[keep]
    pos = ta.column("pos").to_numpy()[keep]
    _, chrom_id = np.unique(chrom, return_inverse=True)
    _, unit = np.unique(chrom_id.astype(np.int64) * (1 << 40) + pos // block, return_inverse=True)
    n_units = int(unit.max()) + 1 if unit.size else 0
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=resamples).astype(np.float64) \
        if n_units else np.zeros((resamples, 0))
    groups = [("all bases", np.ones(diff.size, bool)), ("unmasked", ~masked), ("soft-masked (repeats)", masked)]
    groups += [(_label(lo, hi), (context >= lo) & (context < hi)) for lo, hi in zip(edges, edges[1:])]
    out = []
    for name, mask in groups:
        if not mask.any():
            continue
        sums = np.bincount(unit[mask], weights=diff[mask], minlength=n_units)
        counts = np.bincount(unit[mask], minlength=n_units).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            drawn = (weights @ sums) / (weights @ counts)
        lo, hi = np.nanpercentile(drawn, [2.5, 97.5])
        out.append(GroupGain(name, int(mask.sum()), float(diff[mask].mean()), (float(lo), float(hi)),
                             float((diff[mask] > 0).mean())))
    return out
