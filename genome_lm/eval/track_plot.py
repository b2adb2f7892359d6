"""A picture of ``score``'s tracks over a region (``genome-lm score --plot``, ``genome-lm plot-tracks``).

Three panels over the region's bases: the loss (minus the log-likelihood of the reference base,
nats, a running mean over ``smooth`` bases), the entropy of the predicted distribution (same
smoothing) and the context each base was scored with. Soft-masked (lowercase) reference bases are
shaded grey behind the loss. With the planted copies of a demo genome (its ``.planted.json``), each
later copy in the region is marked: green where its first copy lay inside the window that scored
it (the model could have copied), red where it lay outside; ``copy_context`` says that per base,
and the figure's title gives the mean loss of both groups against the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from genome_lm.data.regions import Region
from genome_lm.errors import GenomeLMError


@dataclass
class TrackView:
    """The tracks of one region, read from ``tracks.parquet``: 0-based positions and the values."""

    chrom: str
    positions: np.ndarray  # int64
    loss: np.ndarray  # -loglik, NaN where the reference is N
    entropy: np.ndarray
    context: np.ndarray
    softmasked: np.ndarray  # bool


def read_region(folder: Path, region: Region | None = None) -> TrackView:
    """The bases of ``region`` (default: the first region scored) from ``folder``/tracks.parquet."""
    path = Path(folder) / "tracks.parquet"
    if not path.is_file():
        raise GenomeLMError(f"{path}: missing (genome-lm score --out {folder} writes it)")
    if region is None:
        first = next(pq.ParquetFile(path).iter_batches(batch_size=1, columns=["chrom"]), None)
        if first is None or not first.num_rows:
            raise GenomeLMError(f"{path}: no bases")
        region = Region(first.column(0)[0].as_py(), 0, None)
    filters = [("chrom", "=", region.name), ("pos", ">", region.start)]  # pos is 1-based
    if region.end is not None:
        filters.append(("pos", "<=", region.end))
    part = pq.read_table(path, columns=["chrom", "pos", "ref", "loglik", "entropy", "context"], filters=filters)
    if not part.num_rows:
        raise GenomeLMError(f"{path}: no scored bases in {region}")
    ref = np.array(part.column("ref").to_pylist())
    return TrackView(region.name, part.column("pos").to_numpy() - 1,
                     -part.column("loglik").to_numpy(zero_copy_only=False).astype(np.float64),
                     part.column("entropy").to_numpy(zero_copy_only=False).astype(np.float64),
                     part.column("context").to_numpy(), np.char.islower(ref))


def first_scored(folder: Path, chrom: str, start: int = 0) -> int | None:
    """The 0-based position of the first base of ``chrom`` at or after ``start`` with a finite
    log-likelihood (past a leading run of N), read a row group at a time."""
    reader = pq.ParquetFile(Path(folder) / "tracks.parquet")
    for batch in reader.iter_batches(columns=["chrom", "pos", "loglik"]):
        keep = pc.and_(pc.and_(pc.equal(batch.column(0), chrom), pc.greater(batch.column(1), start)),
                       pc.invert(pc.is_nan(batch.column(2))))
        found = pc.filter(batch.column(1), keep)
        if len(found):
            return int(found[0].as_py()) - 1
    return None


def copy_context(view: TrackView, planted: list[dict]) -> np.ndarray:
    """Per base of ``view``: 1 where it lies in a planted later copy whose source base (the base it
    copies; an inversion's mirror) was inside the window that scored it, 0 where the source lay
    outside, -1 elsewhere."""
    out = np.full(view.positions.size, -1, dtype=np.int8)
    for copy in planted:
        if copy["chrom"] != view.chrom:
            continue
        inside = (view.positions >= copy["dst_start"]) & (view.positions < copy["dst_end"])
        if not inside.any():
            continue
        offset = view.positions[inside] - copy["dst_start"]
        source = (copy["src_end"] - 1 - offset) if copy["kind"] == "inversion" else copy["src_start"] + offset
        out[inside] = (view.positions[inside] - source <= view.context[inside]).astype(np.int8)
    return out


def _running_mean(values: np.ndarray, width: int) -> np.ndarray:
    """Centred running mean over ``width`` bases, NaN-aware."""
    if width <= 1:
        return values
    ok = ~np.isnan(values)
    kernel = np.ones(width)
    sums = np.convolve(np.where(ok, values, 0.0), kernel, mode="same")
    counts = np.convolve(ok.astype(np.float64), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def _spans(mask: np.ndarray, positions: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) position runs where ``mask`` holds."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(edges[::2], edges[1::2])]


def copy_summary(view: TrackView, where: np.ndarray) -> dict[str, tuple[float, int]]:
    """Mean loss (nats/base) and bases of the later copies with the source in context, out of it,
    and of every other base."""
    out = {}
    for name, mask in (("in context", where == 1), ("out of context", where == 0), ("other bases", where == -1)):
        values = view.loss[mask & ~np.isnan(view.loss)]
        out[name] = (float(values.mean()) if values.size else float("nan"), int(values.size))
    return out


def plot_tracks(view: TrackView, png: Path, *, planted: list[dict] | None = None, smooth: int = 101,
                title: str | None = None) -> dict | None:
    """Write the picture of ``view`` to ``png``; returns ``copy_summary`` with ``planted``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import write_figure

    kb = view.positions / 1e3
    fig, (ax_loss, ax_ent, ax_ctx) = plt.subplots(3, 1, figsize=(12, 6.5), sharex=True,
                                                  gridspec_kw={"height_ratios": [3, 2, 1]})
    for a, b in _spans(view.softmasked, view.positions):
        ax_loss.axvspan(a / 1e3, b / 1e3, color="0.88", lw=0)
    summary = None
    if planted:
        where = copy_context(view, planted)
        for flag, colour in ((1, "tab:green"), (0, "tab:red")):
            for a, b in _spans(where == flag, view.positions):
                ax_loss.axvspan(a / 1e3, b / 1e3, color=colour, alpha=0.35, lw=0)
        summary = copy_summary(view, where)
    ax_loss.plot(kb, _running_mean(view.loss, smooth), lw=0.8, color="k")
    ax_loss.set_ylabel(f"loss, nats/base\n(mean of {smooth})")
    ax_ent.plot(kb, _running_mean(view.entropy, smooth), lw=0.8, color="tab:blue")
    ax_ent.set_ylabel("entropy, nats")
    ax_ctx.plot(kb, view.context, lw=0.8, color="tab:purple")
    ax_ctx.set_ylabel("context, bases")
    ax_ctx.set_xlabel(f"{view.chrom} position (kbp)")
    head = title or f"{view.chrom}:{view.positions[0] + 1:,}-{view.positions[-1] + 1:,}"
    head += "  (grey: soft-masked repeats"
    if summary is not None:
        (i_loss, i_n), (o_loss, o_n), (r_loss, _) = summary.values()
        head += (f"; green: later copies with the first copy in context, {i_loss:.3f} nats/base over {i_n:,} bases; "
                 f"red: first copy out of context, {o_loss:.3f} over {o_n:,}; other bases {r_loss:.3f}")
    ax_loss.set_title(head + ")", fontsize=8, loc="left", wrap=True)
    fig.tight_layout()
    write_figure(fig, Path(png))
    return summary
