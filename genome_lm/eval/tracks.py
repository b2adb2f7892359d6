"""Per-base tracks of a model over a region: each base scored once, in genomic order, with at
least a stated preceding context (issue 50; the ``score`` command builds on this).

A region ``[start, end)`` of a record is cut into **segments** of ``window - context`` bases. The
segment ``[s, e)`` is scored by the window ``[max(0, s - context), e)``: its bases see at least
``context`` bases before them (fewer only within ``context`` of the record's start), and the
bases before ``s`` are read only as context. Consecutive segments touch, so every base of the
region is scored exactly once; the record's first base has nothing before it and is not scored.

For every scored base the model's next-token distribution at the position before it gives:
- ``loglik``: the natural log-probability of the reference base (NaN where the reference is N),
- ``entropy``: the entropy of the whole predicted distribution, nats,
- ``p_a`` ... ``p_t``: the probabilities of A, C, G and T,
- ``context``: the bases before it in its window (what it was scored with).
A window runs in one forward, or through chunked prefill (``chunk``) so memory is bounded by the
chunk whatever the window's length, as in ``eval.score.token_nll``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyBigWig
import torch

from genome_lm.data.regions import Region, parse_region
from genome_lm.data.tokenizer import BASE_TOKENS, N, tokenize
from genome_lm.errors import GenomeLMError
from genome_lm.progress import progress_bar

from .embeddings import EmbeddingSpec, EmbeddingStore, LayerTaps, check_pool, parse_layers, parse_pool

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

    from .embeddings import SegmentRows

TRACKS = ("loglik", "entropy", "p_a", "p_c", "p_g", "p_t", "context")  # in the table's column order


@dataclass(frozen=True)
class Segment:
    """The bases ``[start, end)`` of a record, scored by the window ``[window_start, end)``."""

    window_start: int
    start: int
    end: int


def segments(start: int, end: int, *, window: int, context: int) -> list[Segment]:
    """The segments that score ``[start, end)`` once each (see the module docstring)."""
    if not 1 <= context < window:
        raise GenomeLMError(f"the context ({context:,}) must be at least 1 and shorter than the window ({window:,})")
    if not 0 <= start < end:
        raise GenomeLMError(f"empty or negative region {start:,}-{end:,}")
    step = window - context
    return [Segment(max(0, s - context), s, min(s + step, end)) for s in range(start, end, step)]


@dataclass
class SegmentTracks:
    """The tracks of one segment: ``positions`` (0-based in the record) and one array per track."""

    positions: np.ndarray  # int64 [n]
    loglik: np.ndarray  # float64 [n], NaN where the reference is N
    entropy: np.ndarray  # float64 [n]
    probs: np.ndarray  # float64 [n, 4]: A, C, G, T
    context: np.ndarray  # int64 [n]

    def track(self, name: str) -> np.ndarray:
        if name.startswith("p_"):
            return self.probs[:, "acgt".index(name[2])]
        return getattr(self, name)


def _window_logits(model: GLM5Model, ids: torch.Tensor, chunk: int | None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first input position, logits [n, V] in fp32) of a window's inputs ``ids`` [1, L]."""
    if chunk is None or chunk >= ids.shape[1]:
        yield 0, model(ids).logits[0].float()
        return
    from genome_lm.model.prefill import chunked_logits

    for start, logits in chunked_logits(model, ids, chunk):
        yield start, logits[0].float()


@torch.no_grad()
def score_segment(model: GLM5Model, tokens: np.ndarray, segment: Segment, *, chunk: int | None = None,
                  token_map: torch.Tensor | None = None, taps: LayerTaps | None = None,
                  rows: SegmentRows | None = None) -> SegmentTracks:
    """The tracks of ``segment``; ``tokens``: genome-lm token ids of the record (or of any stretch
    of it holding the segment's window, with ``segment`` in its coordinates). With ``taps`` (hooks
    on the model's layers, ``eval.embeddings``) the embeddings of every base of the segment (the
    record's first included) go to ``rows`` as each chunk is computed; the window's last base is
    then fed too, for its own embedding."""
    from .score import _model_ids

    window = np.asarray(tokens[segment.window_start:segment.end])
    first = max(segment.start, 1) - segment.window_start  # window offset of the first scored base
    ids = _model_ids(model, window, token_map, None)[None]
    columns = torch.tensor(BASE_TOKENS, dtype=torch.long)  # A C G T
    if token_map is not None:
        columns = token_map[columns]
    n = len(window) - first
    loglik, entropy = np.full(n, np.nan), np.full(n, np.nan)  # NaN until computed: a gap would show
    probs = np.full((n, 4), np.nan)
    targets = torch.from_numpy(window.astype(np.int64))
    if token_map is not None:
        targets = token_map[targets]
    first_row = segment.start - segment.window_start  # window offset of the first embedded base
    for start, logits in _window_logits(model, ids if taps else ids[:, :-1], chunk):
        if taps is not None:
            hidden = taps.take()
            if start + logits.shape[0] > first_row:
                rows.add({name: h[max(first_row - start, 0):] for name, h in hidden.items()})
        # the inputs whose next base is scored
        lo, hi = max(start, first - 1), min(start + logits.shape[0], len(window) - 1)
        if lo >= hi:
            continue
        logp = torch.log_softmax(logits[lo - start:hi - start], dim=-1).double()
        out = slice(lo + 1 - first, hi + 1 - first)
        loglik[out] = logp.gather(1, targets[lo + 1:hi + 1, None].to(logp.device)).squeeze(1).cpu().numpy()
        entropy[out] = -(logp.exp() * logp).sum(-1).cpu().numpy()
        probs[out] = logp[:, columns.to(logp.device)].exp().cpu().numpy()
    if rows is not None:
        rows.close()
    loglik[window[first:] == N] = np.nan
    positions = np.arange(segment.window_start + first, segment.end, dtype=np.int64)
    return SegmentTracks(positions, loglik, entropy, probs, positions - segment.window_start)


class BigWigs:
    """One bigWig per track (``files``: track -> path), written as segments come (``add``), which
    must be in genomic order: chromosomes in ``chrom_sizes``' order, positions rising. NaN values
    get no entry."""

    def __init__(self, files: dict[str, Path], chrom_sizes: dict[str, int]):
        self.handles = {}
        try:
            for track, path in files.items():
                bw = pyBigWig.open(str(path), "w")
                bw.addHeader(list(chrom_sizes.items()), maxZooms=10)
                self.handles[track] = bw
        except BaseException:
            self.close()
            raise

    def add(self, chrom: str, seg: SegmentTracks) -> None:
        for track, bw in self.handles.items():
            values = seg.track(track).astype(np.float64)
            keep = ~np.isnan(values)
            if keep.any():
                bw.addEntries(chrom, seg.positions[keep].tolist(), values=values[keep].tolist(), span=1)

    def close(self) -> None:
        for bw in self.handles.values():
            bw.close()
        self.handles = {}


class Table:
    """The tracks as one Parquet table, a row group per segment: ``chrom``, ``pos`` (1-based),
    ``ref`` (the base as in the FASTA, soft-masked lowercase), then the tracks."""

    def __init__(self, path: Path, tracks: tuple[str, ...]):
        self.tracks = tracks
        fields = [pa.field("chrom", pa.string()), pa.field("pos", pa.int64()), pa.field("ref", pa.string())]
        fields += [pa.field(t, pa.int64() if t == "context" else pa.float32()) for t in tracks]
        self.schema = pa.schema(fields)
        self.writer = pq.ParquetWriter(str(path), self.schema)

    def add(self, chrom: str, seg: SegmentTracks, ref: bytes) -> None:
        columns = {"chrom": pa.array([chrom] * len(seg.positions), pa.string()),
                   "pos": pa.array(seg.positions + 1), "ref": pa.array(list(ref.decode("ascii")), pa.string())}
        for t in self.tracks:
            values = seg.track(t)
            columns[t] = pa.array(values if t == "context" else values.astype(np.float32), from_pandas=True)
        self.writer.write_table(pa.table(columns, schema=self.schema))

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True)
class ScoreRequest:
    model: str  # anything eval's --model takes
    fasta: Path
    regions: tuple[str, ...]  # chromosomes or chr:start-end (1-based, inclusive)
    out: Path
    bed: Path | None = None  # intervals of a BED file (0-based, half-open), beside ``regions``
    window: int = 32_768
    context: int = 8_192
    chunk: int | None = None
    probs: bool = False  # also the A/C/G/T probability tracks
    layout: dict | None = None  # over many ranks: ParallelSizes fields (eval's --set parallel.*)
    embeddings: str | None = None  # layers whose hidden states go to embeddings.zarr (``embeddings.parse_layers``)
    pool: str | None = None  # embeddings per base (None, "none") or "mean:N"
    embedding_dtype: str = "float16"  # or float32


def read_bed(path: Path) -> list[Region]:
    """The intervals of a BED file (0-based, half-open: chrom, start, end, then anything), skipping
    blank, ``#``, ``track`` and ``browser`` lines; a bad line is a one-line error naming it."""
    regions = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise GenomeLMError(f"{path}: cannot read ({exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith(("#", "track", "browser")):
            continue
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) < 3:
            raise GenomeLMError(f"{path}:{number}: a BED line needs chrom, start and end ({len(fields)} fields)")
        try:
            start, end = int(fields[1]), int(fields[2])
        except ValueError:
            raise GenomeLMError(f"{path}:{number}: start and end must be whole numbers ({fields[1]!r}, "
                                f"{fields[2]!r})") from None
        if not 0 <= start < end:
            raise GenomeLMError(f"{path}:{number}: an interval needs 0 <= start < end (0-based, end exclusive), "
                                f"got {start}-{end}")
        regions.append(Region(fields[0], start, end))
    if not regions:
        raise GenomeLMError(f"{path}: no intervals")
    return regions


def _regions_in_order(req: ScoreRequest, source) -> list:
    """The regions bounded by their records, in the FASTA's order; overlapping ones refused."""
    names = source.names()
    regions = []
    asked = [parse_region(text, names) for text in req.regions]
    if req.bed is not None:
        asked += read_bed(req.bed)
    if not asked:
        raise GenomeLMError("no regions to score: give --regions or --bed")
    for region in asked:
        if region.name not in names:
            raise GenomeLMError(f"{req.fasta}: no record {region.name!r} (records: {', '.join(names[:5])}"
                                f"{' ...' if len(names) > 5 else ''})")
        regions.append(region.bounded(source.length(region.name), str(req.fasta)))
    regions.sort(key=lambda r: (names.index(r.name), r.start))
    for a, b in zip(regions, regions[1:]):
        if a.name == b.name and b.start < a.end:
            raise GenomeLMError(f"regions {a} and {b} overlap: each base is scored once (merge them)")
    return regions


def score_fasta(req: ScoreRequest, *, progress: bool = True) -> dict | None:
    """Score ``req.regions`` of ``req.fasta`` with ``req.model`` into ``req.out``: ``tracks.parquet``
    (every scored base), one bigWig per track (``loglik.bw``, ``entropy.bw``, ``context.bw``, with
    ``probs`` also ``p_a.bw`` ... ``p_t.bw``), with ``embeddings`` ``embeddings.zarr``, and
    ``score.json`` (the settings, the model and the counts); returns score.json's content.

    The work goes into ``OUT.partial``: each segment's tracks are saved there as soon as they are
    computed (``parts/``), and the outputs are assembled from the parts and the folder renamed when
    every segment is done. An interrupted run, run again with the same settings and model, scores
    only the segments it lacks, and gives the files an unbroken run gives; with other settings it
    is refused in one line. An error before any segment is scored leaves nothing behind.

    Over many ranks (torchrun; every rank calls this, ``req.layout`` splitting the model as eval's
    ``--set parallel.*`` does) the segments are shared out like eval's windows
    (``parallel.window_groups``): a group of one rank scores its segment through chunked prefill,
    a split group (tensor, context, expert, pipeline parallel) in one forward
    (``parallel.split_window_tracks``).
    Each group's lead writes its segment's part and embedding chunks itself (disjoint files: OUT must
    be on a filesystem every rank sees); rank 0 prepares the folder, assembles the outputs and
    returns the summary, the other ranks return None."""
    import torch.distributed as dist

    from genome_lm.engine.parallel import ParallelSizes, parallel_context

    from .evaluate import eval_heap
    from .models import load_model

    out = Path(req.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GenomeLMError(f"{out}: exists and is not empty; score into a new folder")
    segments(0, 1, window=req.window, context=req.context)  # the window and context, checked first
    pool = parse_pool(req.pool)
    if req.embeddings is None and (pool > 1 or req.pool):
        raise GenomeLMError("--pool shapes the embeddings: give --embeddings LAYERS too")
    if req.embedding_dtype not in ("float16", "float32"):
        raise GenomeLMError(f"--embedding-dtype {req.embedding_dtype}: expected float16 or float32")
    check_pool(pool, req.window - req.context)
    sizes = ParallelSizes(**req.layout) if req.layout else ParallelSizes()
    with parallel_context(sizes, host_heap=eval_heap(sizes)) as pg:
        rank = dist.get_rank()
        loaded = load_model(req.model, pg, sizes=sizes)
        model = loaded.model.eval()
        spec = None
        if req.embeddings is not None:
            spec = EmbeddingSpec(parse_layers(req.embeddings, model.cfg.num_hidden_layers), pool,
                                 req.embedding_dtype)
        partial = out.with_name(out.name + ".partial")
        job = _Job(req, out, partial, spec, loaded, sizes, dist.get_world_size() > 1)
        shared = [None]
        if rank == 0:
            try:
                shared[0] = job.prepare()
            except GenomeLMError as err:
                shared[0] = err
        if job.many:
            dist.broadcast_object_list(shared, src=0)
        if isinstance(shared[0], GenomeLMError):
            raise shared[0]
        job.regions, job.plan, missing, job.handle = shared[0]
        try:
            job.score(pg, missing, progress and rank == 0)
        except BaseException:
            if rank == 0:
                job.clean_if_empty()
            raise
        if job.many:
            dist.barrier()
    if rank != 0:
        return None
    summary = job.finish()
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(partial, out)
    return summary


class _Job:
    """One ``score_fasta`` run: rank 0 prepares the folder (``prepare``), every rank scores its
    share of the missing segments (``score``), rank 0 assembles the outputs (``finish``)."""

    def __init__(self, req: ScoreRequest, out: Path, partial: Path, spec, loaded, sizes, many: bool):
        self.req, self.out, self.partial, self.spec, self.loaded, self.sizes = req, out, partial, spec, loaded, sizes
        self.parts = partial / "parts"
        self.many = many
        self.fresh = not partial.exists()
        self.tracks = tuple(t for t in TRACKS if req.probs or not t.startswith("p_"))
        self.regions: list[Region] = []
        self.plan: list = []
        self.handle = None  # data.fasta.FastaHandle: how every rank reads the FASTA that rank 0 validated
        self.chrom_sizes: dict[str, int] = {}  # rank 0, for the bigWig headers

    def prepare(self) -> tuple:
        """Rank 0: the folder, the regions, the plan of segments, the indices of those to score and
        the FASTA's handle (the file validated and indexed once, here; the other ranks only read it)."""
        from genome_lm.data.fasta import open_fasta, quick_identity
        from genome_lm.data.prepare import default_cache_dir

        from .cache import weights_fingerprint

        req, model = self.req, self.loaded.model
        self.parts.mkdir(parents=True, exist_ok=True)
        try:
            source = open_fasta(Path(req.fasta), self.partial / ".work", default_cache_dir())
            regions = _regions_in_order(req, source)
            self.chrom_sizes = {r.name: source.length(r.name) for r in regions}
            spec = self.spec
            identity = {"model": str(req.model), "weights": weights_fingerprint(model),
                        "fasta": quick_identity(Path(req.fasta)), "regions": [str(r) for r in regions],
                        "window": req.window, "context": req.context, "chunk": req.chunk, "tracks": list(self.tracks),
                        "embeddings": None if spec is None else vars(spec) | {"layers": list(spec.layers)}}
            _same_request(self.partial / "request.json", identity)
            if spec is not None:
                EmbeddingStore(self.partial / "embeddings.zarr", regions, spec, model.cfg.hidden_size,
                               req.window - req.context, {"model": str(req.model)})
        except BaseException:
            self.clean_if_empty()
            raise
        plan = [(i, j, region, seg) for i, region in enumerate(regions)
                for j, seg in enumerate(segments(region.start, region.end, window=req.window, context=req.context))]
        missing = [k for k, (i, j, _, _) in enumerate(plan) if not self._part(i, j).exists()]
        return regions, plan, missing, source.handle

    def _part(self, i: int, j: int) -> Path:
        return self.parts / f"{i:05d}-{j:07d}.npz"

    def clean_if_empty(self) -> None:
        """Nothing scored by a run that made the folder: leave nothing behind."""
        if self.fresh and not any(self.parts.glob("*.npz")):
            shutil.rmtree(self.partial, ignore_errors=True)

    def score(self, pg, missing: list[int], progress: bool) -> None:
        """Every rank: the missing segments, a round of one per window group at a time."""
        import torch.distributed as dist

        from genome_lm.data.fasta import fetch_bytes

        from .parallel import split_model, window_groups

        req, model, spec = self.req, self.loaded.model, self.spec
        fasta = self.handle.open()
        store = None
        if spec is not None:
            store = EmbeddingStore(self.partial / "embeddings.zarr", self.regions, spec, model.cfg.hidden_size,
                                   req.window - req.context)
        group, groups, lead = window_groups(pg, self.sizes) if self.many else (0, 1, True)
        split = split_model(self.sizes)
        def bases(ks) -> int:  # the bases the plan's segments ``ks`` score
            return sum(self.plan[k][3].end - self.plan[k][3].start for k in ks)

        with progress_bar(quiet=not progress) as bar, LayerTaps(model, spec.layers if spec else ()) as taps:
            task = bar.add_task("score", total=bases(range(len(self.plan))), unit="bp")
            bar.advance(task, bases(range(len(self.plan))) - bases(missing))  # scored by an earlier run
            for first in range(0, len(missing), groups):
                if first + group < len(missing):
                    i, j, region, seg = self.plan[missing[first + group]]
                    text = fetch_bytes(fasta, self.handle, region.name, seg.window_start, seg.end)
                    local = Segment(0, seg.start - seg.window_start, seg.end - seg.window_start)
                    rows = store.segment(i, seg.start) if store is not None and lead else None
                    if split:
                        part = _split_segment(model, pg, tokenize(text), local, self.loaded.token_map,
                                              taps if store else None, rows)
                    else:
                        part = score_segment(model, tokenize(text), local, chunk=req.chunk,
                                             token_map=self.loaded.token_map, taps=taps if store else None, rows=rows)
                    if lead:  # (its embeddings, if any, are written before it)
                        ref = np.frombuffer(text, dtype=np.uint8)[len(text) - len(part.positions):]  # the scored tail
                        _save_part(self._part(i, j), part, seg.window_start, ref)
                if self.many:
                    dist.barrier()  # this round's parts are on disk before rank 0 counts them
                bar.advance(task, bases(missing[first:first + groups]))

    def finish(self) -> dict:
        """Rank 0: the outputs from the parts, and score.json."""
        req, spec, model = self.req, self.spec, self.loaded.model
        lacking = [self._part(i, j).name for i, j, _, _ in self.plan if not self._part(i, j).exists()]
        if lacking:
            raise GenomeLMError(f"{self.parts}: {len(lacking)} segments' parts missing after scoring (first "
                                f"{lacking[0]}): OUT must be on a filesystem every rank writes to")
        scored = _assemble(self.partial, self.parts, self.plan, self.tracks, self.chrom_sizes)
        shutil.rmtree(self.partial / ".work", ignore_errors=True)
        summary = {"schema": "genome-lm.score/1", "model": str(req.model), "model_info": vars(self.loaded.info),
                   "fasta": str(req.fasta), "regions": [str(r) for r in self.regions], "window": req.window,
                   "context": req.context, "chunk": req.chunk, "tracks": list(self.tracks), "bases_scored": scored,
                   "embeddings": None if spec is None else {"layers": list(spec.layers), "pool": spec.pool,
                                                            "dtype": spec.dtype, "hidden_size": model.cfg.hidden_size},
                   "files": sorted(["score.json", "tracks.parquet", *(f"{t}.bw" for t in self.tracks),
                                    *(["embeddings.zarr"] if spec else [])])}
        shutil.rmtree(self.parts)
        (self.partial / "request.json").unlink()
        (self.partial / "score.json").write_text(json.dumps(summary, indent=1, default=str))
        return summary


def _split_segment(model, pg, tokens: np.ndarray, segment: Segment, token_map, taps, rows) -> SegmentTracks:
    """``score_segment`` for a model split inside its window group (``parallel.split_window_tracks``),
    the same on every rank of the group; ``rows`` (the lead's) get the embeddings."""
    from .parallel import split_window_tracks
    from .score import _model_ids

    window = np.asarray(tokens[segment.window_start:segment.end])
    first = max(segment.start, 1) - segment.window_start
    columns = torch.tensor(BASE_TOKENS, dtype=torch.long)
    if token_map is not None:
        columns = token_map[columns]
    stats, hidden = split_window_tracks(model, pg, _model_ids(model, window, token_map, None), columns, taps)
    stats = stats[first - 1:].cpu().numpy()
    if rows is not None:
        at = segment.start - segment.window_start
        rows.add({name: h[at:] for name, h in hidden.items()})
        rows.close()
    loglik = stats[:, 0].copy()
    loglik[window[first:] == N] = np.nan
    positions = np.arange(segment.window_start + first, segment.end, dtype=np.int64)
    return SegmentTracks(positions, loglik, stats[:, 1].copy(), stats[:, 2:].copy(), positions - segment.window_start)


def _same_request(path: Path, identity: dict) -> None:
    """Record what an interrupted run was doing, or check that this run does the same."""
    if path.exists():
        recorded = json.loads(path.read_text())
        if recorded != identity:
            differ = ", ".join(k for k in identity if recorded.get(k) != identity[k])
            raise GenomeLMError(f"{path.parent}: an interrupted score with other settings ({differ} differ); run it "
                                "again with its own, or delete the folder to start over")
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(identity, indent=1, default=str))
    os.replace(tmp, path)


def _save_part(file: Path, part: SegmentTracks, offset: int, ref: np.ndarray) -> None:
    """One segment's tracks, written whole or not at all."""
    tmp = file.with_name(file.stem + ".tmp.npz")
    np.savez(tmp, positions=part.positions + offset, loglik=part.loglik, entropy=part.entropy, probs=part.probs,
             context=part.context, ref=ref)
    os.replace(tmp, file)


def _assemble(partial: Path, parts: Path, plan: list, tracks: tuple[str, ...], chrom_sizes: dict) -> int:
    """The bigWigs and the table from the segments' parts, in genomic order; returns the bases."""
    bigwigs = BigWigs({t: partial / f"{t}.bw" for t in tracks}, chrom_sizes)
    table = Table(partial / "tracks.parquet", tracks)
    scored = 0
    try:
        for i, j, region, _ in plan:
            with np.load(parts / f"{i:05d}-{j:07d}.npz") as saved:
                part = SegmentTracks(saved["positions"], saved["loglik"], saved["entropy"], saved["probs"],
                                     saved["context"])
                ref = saved["ref"].tobytes()
            bigwigs.add(region.name, part)
            table.add(region.name, part, ref)
            scored += len(part.positions)
    finally:
        bigwigs.close()
        table.close()
    return scored
