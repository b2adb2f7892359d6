"""Hidden states of chosen layers, per base or pooled over bins, written to Zarr as ``score``
goes (``genome-lm score --embeddings``; issue 50).

**What a layer's embedding is.** Each decoder layer carries ``hc_mult`` hyper-connection streams
of ``hidden_size`` values per position; a layer's embedding of a position is their mean, the
same reduction the model applies before its final norm. ``final`` is the final norm's output:
what the output layer reads. The embedding of base ``p`` is the hidden state at input position
``p``, after the model has read ``p`` itself and the bases before it in its window (the tracks'
scores of ``p`` come from position ``p - 1``).

**Layout** (``OUT/embeddings.zarr``, Zarr v3): the root's attributes give the layers, the pool
size, the dtype and the regions; one group per region (``0``, ``1``, ... in the FASTA's order,
attributes ``chrom``, ``start``, ``end``, 0-based half-open) holds one array per layer,
``[rows, hidden_size]``, and ``start`` / ``end`` ``[rows]``: the bases each row covers. Per
base a row is a base (every base of the region, the record's first one included); with
``pool`` = N a row is the mean of N consecutive bases from the region's start (the last row
of a region may hold fewer).

**Bounded memory, resumable.** Rows are buffered as the chunked prefill produces them and
written a Zarr chunk at a time; a chunk never spans two segments (its row count divides the
rows of a segment), so a segment that an interruption cut short is simply written again when
the run continues, and no finished segment's chunk is touched. The buffer holds at most one
chunk of rows per layer, whatever the region's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import zarr

from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.data.regions import Region
    from genome_lm.model.model import GLM5Model

EMBEDDINGS_SCHEMA = "genome-lm.embeddings/1"
FINAL = "final"
BUFFER_BYTES = 16 << 20  # the most fp32 bytes of raw rows buffered per layer before a write


@dataclass(frozen=True)
class EmbeddingSpec:
    layers: tuple[str, ...]  # "final" or "layer_<i>" (``parse_layers``)
    pool: int = 1  # bases per row
    dtype: str = "float16"


def parse_layers(text: str, n_layers: int) -> tuple[str, ...]:
    """``--embeddings`` text: comma-separated layer indices (from 0; negative from the end) or
    ``final`` (the default when empty) -> names ``layer_<i>`` / ``final``, in the order given."""
    names = []
    for item in (part.strip() for part in (text or FINAL).split(",")):
        if item in (FINAL, "last"):
            name = FINAL
        else:
            try:
                index = int(item)
            except ValueError:
                raise GenomeLMError(f"--embeddings {text}: {item!r} is not a layer (a layer index from 0 to "
                                    f"{n_layers - 1}, negative from the end, or 'final')") from None
            if not -n_layers <= index < n_layers:
                raise GenomeLMError(f"--embeddings {text}: layer {index} does not exist (the model has {n_layers} "
                                    f"layers, 0 to {n_layers - 1}; or 'final')")
            name = f"layer_{index % n_layers}"
        if name not in names:
            names.append(name)
    return tuple(names)


def parse_pool(text: str | None) -> int:
    """``--pool`` text: ``none`` (per base) or ``mean:N`` -> bases per row."""
    if not text or text == "none":
        return 1
    kind, _, size = text.partition(":")
    if kind != "mean" or not size.isdigit() or int(size) < 1:
        raise GenomeLMError(f"--pool {text}: expected 'none' or 'mean:N' with N a whole number of bases >= 1")
    return int(size)


def check_pool(pool: int, step: int) -> None:
    """A bin of ``pool`` bases must divide a segment's ``step`` new bases."""
    if pool > step or step % pool:
        raise GenomeLMError(f"--pool mean:{pool}: the bin must divide the bases each window adds (window less "
                            f"context: {step:,}), so that no bin straddles two windows")


class LayerTaps:
    """Forward hooks that keep the chosen layers' embeddings of the positions of the latest
    forward (or prefill chunk): ``take()`` -> {name: [positions, hidden_size] fp32}. One sequence
    per batch; used as a context manager, so the hooks go when it ends."""

    def __init__(self, model: GLM5Model, layers: tuple[str, ...]):
        self.names = layers
        self.latest: dict[str, torch.Tensor] = {}
        self.handles = []
        offset = getattr(model, "layer_offset", 0)
        here = getattr(model, "global_layers", range(len(model.layers)))
        try:
            for name in layers:  # under pipeline parallel, those of this stage's layers only
                if name == FINAL:
                    if not getattr(model, "post_process", True):
                        continue
                    module, reduce = model.final_norm, lambda out: out
                else:
                    index = int(name.split("_")[1])
                    if index not in here:
                        continue
                    module, reduce = model.layers[index - offset], lambda out: out[0].mean(dim=2)
                self.handles.append(module.register_forward_hook(self._keep(name, reduce)))
        except BaseException:
            self.close()
            raise

    def _keep(self, name: str, reduce):
        def hook(_module, _args, output):
            self.latest[name] = reduce(output)[:, 0].float()  # [S, B, D] -> [S, D] of the one sequence
        return hook

    def take(self) -> dict[str, torch.Tensor]:
        latest, self.latest = self.latest, {}
        return latest

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> LayerTaps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def chunk_rows(rows_per_segment: int, pool: int, width: int) -> int:
    """Rows per Zarr chunk: the largest divisor of a segment's rows whose raw bases fit
    ``BUFFER_BYTES`` per layer (at least one row)."""
    limit = max(1, BUFFER_BYTES // (4 * width * pool))
    best = 1
    for d in range(1, math.isqrt(rows_per_segment) + 1):
        if rows_per_segment % d == 0:
            for c in (d, rows_per_segment // d):
                if c <= limit:
                    best = max(best, c)
    return best


class EmbeddingStore:
    """``OUT/embeddings.zarr`` (see the module docstring): created on the first run, opened
    again by a run that continues; ``segment`` gives the writer of one segment's rows."""

    def __init__(self, path: Path, regions: list[Region], spec: EmbeddingSpec, width: int, step: int,
                 attrs: dict | None = None):
        check_pool(spec.pool, step)
        self.spec, self.width, self.step = spec, width, step
        self.rows = step // spec.pool  # rows of a whole segment
        self.chunk = chunk_rows(self.rows, spec.pool, width)
        self.regions = regions
        if Path(path).exists():
            self.root = zarr.open_group(str(path), mode="r+")
            return
        root = zarr.open_group(str(path), mode="w-")
        root.attrs.update({"schema": EMBEDDINGS_SCHEMA, "layers": list(spec.layers), "pool": spec.pool,
                           "dtype": spec.dtype, "hidden_size": width, **(attrs or {}),
                           "regions": [{"group": str(i), "chrom": r.name, "start": r.start, "end": r.end}
                                       for i, r in enumerate(regions)]})
        for i, region in enumerate(regions):
            group = root.create_group(str(i))
            group.attrs.update({"chrom": region.name, "start": region.start, "end": region.end})
            n = -(-(region.end - region.start) // spec.pool)
            starts = region.start + np.arange(n, dtype=np.int64) * spec.pool
            for name, values in (("start", starts), ("end", np.minimum(starts + spec.pool, region.end))):
                group.create_array(name, shape=(n,), chunks=(max(1, min(n, 1 << 20)),), dtype="int64")[:] = values
            for layer in spec.layers:
                group.create_array(layer, shape=(n, width), chunks=(self.chunk, width), dtype=spec.dtype,
                                   fill_value=np.nan)
        self.root = root

    def segment(self, region: int, start: int) -> SegmentRows:
        """The writer of the rows of region ``region``'s segment that starts at base ``start``."""
        first = start - self.regions[region].start
        return SegmentRows(self, self.root[str(region)], first // self.spec.pool,
                           self.regions[region].end - start)


class SegmentRows:
    """One segment's embeddings, added as the prefill produces them (``add``: the next bases'
    rows, in order), written to the store a whole Zarr chunk at a time; ``close`` writes the
    rest. Pooled rows are the mean of their bins."""

    def __init__(self, store: EmbeddingStore, group, first_row: int, bases_left: int):
        self.store, self.group, self.row = store, group, first_row
        self.pool = store.spec.pool
        self.bases = min(store.step, bases_left)  # bases of this segment
        self.block = store.chunk * self.pool  # raw bases per write
        self.pending: dict[str, list[np.ndarray]] = {name: [] for name in store.spec.layers}
        self.held = 0
        self.added = 0

    def add(self, rows: dict[str, torch.Tensor]) -> None:
        n = next(iter(rows.values())).shape[0]
        if self.added + n > self.bases:
            raise ValueError(f"{self.added + n} bases given to a segment of {self.bases}")
        for name in self.pending:
            self.pending[name].append(rows[name].detach().cpu().numpy().astype(np.float32, copy=False))
        self.held += n
        self.added += n
        while self.held >= self.block:
            self._write(self.block)

    def close(self) -> None:
        if self.added != self.bases:
            raise ValueError(f"a segment of {self.bases} bases was given {self.added}")
        if self.held:
            self._write(self.held)

    def _write(self, n: int) -> None:
        rows = -(-n // self.pool)
        for name, parts in self.pending.items():
            raw = np.concatenate(parts) if len(parts) > 1 else parts[0]
            take, rest = raw[:n], raw[n:]
            if self.pool > 1:
                sums = np.add.reduceat(take, np.arange(0, n, self.pool), axis=0, dtype=np.float64)
                counts = np.minimum(self.pool, n - np.arange(0, n, self.pool))[:, None]
                take = sums / counts
            self.group[name][self.row:self.row + rows] = take.astype(self.store.spec.dtype)
            self.pending[name] = [rest] if len(rest) else []
        self.row += rows
        self.held -= n


def read_embeddings(path: Path, layer: str = FINAL) -> list[tuple[dict, np.ndarray, np.ndarray]]:
    """(region attributes, start [rows], values [rows, hidden_size]) per region of an embeddings
    store, for readers and tests."""
    root = zarr.open_group(str(path), mode="r")
    if root.attrs.get("schema") != EMBEDDINGS_SCHEMA:
        raise GenomeLMError(f"{path}: not a genome-lm embeddings store")
    return [(dict(root[r["group"]].attrs), root[r["group"]]["start"][:], root[r["group"]][layer][:])
            for r in root.attrs["regions"]]
