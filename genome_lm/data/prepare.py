"""`genome-lm prepare`: a genome FASTA -> tokenized windows in Megatron indexed datasets.

The work runs in four steps:

1. validate and index the FASTA (:mod:`genome_lm.data.fasta`);
2. resolve the requested chromosomes and plan windows (:mod:`genome_lm.data.windows`);
3. tokenize runs of windows in parallel -- local processes, or Ray tasks with ``ray_address``
   -- into part files (:mod:`genome_lm.data.shards`);
4. join the parts, in a fixed order, into one ``.bin/.idx`` per split with megatron-core's
   ``IndexedDatasetBuilder`` and write the manifest (:mod:`genome_lm.data.manifest`).

Because step 4 always joins parts in task order, the output is byte-identical however many
workers ran step 3. Everything is built in a hidden staging folder beside ``out`` and renamed
into place at the end, so ``out`` is either a complete dataset or absent. Finished parts
survive an interruption and are reused by the next run with the same request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Iterator

import numpy as np

from genome_lm.data.fasta import FastaSource, open_fasta, quick_identity
from genome_lm.data.manifest import MANIFEST, SCHEMA, Manifest, write_manifest
from genome_lm.data.names import resolve
from genome_lm.data.shards import Task, part_paths, run_task
from genome_lm.data.tokenizer import TokenizerInfo
from genome_lm.data.windows import WindowSpec, plan_windows
from genome_lm.errors import GenomeLMError
from genome_lm.progress import progress_bar

STUDY_WINDOW = 524_288
TASK_BASES = 32 << 20  # a task covers about this many bases: fine enough for progress and balance


@dataclass(frozen=True)
class PrepareRequest:
    """Everything that shapes the output (and nothing that does not, such as worker counts)."""

    fasta: Path
    out: Path
    train_chroms: tuple[str, ...] = ("chr1", "chr2")
    eval_chroms: tuple[str, ...] = ("chr22",)
    windows: WindowSpec = field(default_factory=lambda: WindowSpec(STUDY_WINDOW, STUDY_WINDOW))

    def key(self) -> str:
        payload = {
            "source": quick_identity(Path(self.fasta)),
            "splits": {"train": list(self.train_chroms), "eval": list(self.eval_chroms)},
            "windows": asdict(self.windows),
            "schema": SCHEMA,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class PrepareResult:
    out: Path
    reused: bool
    manifest: Manifest


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "genome-lm"


def prepare(
    request: PrepareRequest,
    *,
    workers: int | None = None,
    ray_address: str | None = None,
    force: bool = False,
    quiet: bool = False,
    cache_dir: Path | None = None,
) -> PrepareResult:
    """Build (or reuse) the dataset described by ``request``; see the module docstring."""
    out = Path(request.out)
    fasta = Path(request.fasta)
    if not fasta.exists():
        raise GenomeLMError(f"{fasta}: no such file")
    _check_splits(request)
    parent = _writable_parent(out)
    key = request.key()
    with _exclusive(parent / f".{out.name}.lock"):
        if out.exists() and not force:
            existing = _existing_dataset(out)
            if existing is not None and existing.request_key == key:
                return PrepareResult(out, True, existing)
        if out.exists() and not (out / MANIFEST).exists() and any(out.iterdir()):
            raise GenomeLMError(f"{out}: exists and is not a genome-lm dataset; choose another --out")

        staging = parent / f".{out.name}.partial"
        _reset_unless_same_request(staging, key)
        try:
            _build(request, key, staging, out, workers, ray_address, quiet, cache_dir or default_cache_dir())
        except GenomeLMError:
            # Bad input: nothing worth resuming. (An interrupt keeps the finished parts.)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return PrepareResult(out, False, Manifest.load(out))


def _build(request, key, staging, out, workers, ray_address, quiet, cache_dir) -> None:
    parts = staging / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    with progress_bar(quiet) as progress:
        source = _open_source(Path(request.fasta), staging, cache_dir, progress)
        splits = _resolve_splits(request, source)
        tasks, dropped = _plan_tasks(splits, request.windows)
        results = _run_tasks(tasks, source, request.windows.max_n_frac, parts, workers, ray_address, progress)
        final = staging / "final"
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir()
        split_data = _write_splits(final, tasks, results, parts, splits, dropped, source.handle.display, progress)
    manifest = {
        "schema": SCHEMA,
        "request_key": key,
        "source": {**source.identity, "records": [asdict(r) for r in source.records]},
        "tokenizer": TokenizerInfo().to_json(),
        "windows": asdict(request.windows),
        "splits": split_data,
    }
    write_manifest(final, manifest)
    _swap_into_place(final, out)


def _check_splits(request: PrepareRequest) -> None:
    if not request.train_chroms and not request.eval_chroms:
        raise GenomeLMError("no chromosomes requested: give --train-chroms and/or --eval-chroms")
    both = set(request.train_chroms) & set(request.eval_chroms)
    if both:
        raise GenomeLMError(f"chromosome(s) {', '.join(sorted(both))} requested for both train and eval")


def _writable_parent(out: Path) -> Path:
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GenomeLMError(f"{out}: cannot create output folder ({exc.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GenomeLMError(f"{out}: output folder {parent} is not writable")
    return parent


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """One `prepare` per output folder at a time."""
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GenomeLMError(f"{lock_path.parent}: another `genome-lm prepare` is writing there") from None
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)


def _existing_dataset(out: Path) -> Manifest | None:
    try:
        return Manifest.load(out)
    except GenomeLMError:
        return None


def _reset_unless_same_request(staging: Path, key: str) -> None:
    marker = staging / "request_key"
    if staging.exists() and not (marker.exists() and marker.read_text() == key):
        shutil.rmtree(staging)
    staging.mkdir(exist_ok=True)
    marker.write_text(key)


def _open_source(fasta: Path, staging: Path, cache_dir: Path, progress) -> FastaSource:
    bar = progress.add_task(f"checking {fasta.name}", total=fasta.stat().st_size, unit="B")
    source = open_fasta(fasta, staging, cache_dir, on_bytes=lambda n: progress.advance(bar, n))
    progress.update(bar, completed=fasta.stat().st_size)
    return source


@dataclass(frozen=True)
class _Chrom:
    requested: str
    record: str
    length: int


def _resolve_splits(request: PrepareRequest, source: FastaSource) -> dict[str, list[_Chrom]]:
    names = source.names()
    display = source.handle.display
    splits: dict[str, list[_Chrom]] = {}
    seen: dict[str, str] = {}
    for split, requested in (("train", request.train_chroms), ("eval", request.eval_chroms)):
        if not requested:
            continue
        chroms = []
        for name in requested:
            record = resolve(name, names, display)
            if record in seen:
                raise GenomeLMError(f"{display}: {name!r} and {seen[record]!r} are the same record {record!r}")
            seen[record] = name
            chroms.append(_Chrom(name, record, source.length(record)))
        splits[split] = chroms
    return splits


def _plan_tasks(splits: dict[str, list[_Chrom]], spec: WindowSpec) -> tuple[list[Task], dict[str, list]]:
    per_task = max(1, TASK_BASES // spec.window)
    tasks: list[Task] = []
    dropped: dict[str, list] = {split: [] for split in splits}
    for split, chroms in splits.items():
        for chrom in chroms:
            windows, tail = plan_windows(chrom.length, spec)
            if tail is not None:
                dropped[split].append({"chrom": chrom.record, "start": tail[0], "end": tail[1]})
            for i in range(0, len(windows), per_task):
                tasks.append(Task(len(tasks), split, chrom.record, tuple(windows[i : i + per_task])))
    return tasks, dropped


def _run_tasks(tasks, source, max_n_frac, parts: Path, workers, ray_address, progress) -> dict[int, dict]:
    bar = progress.add_task("tokenizing", total=sum(t.bases for t in tasks), unit="bp")
    workers = workers or _default_workers(len(tasks))
    if ray_address is not None:
        stream = _ray_map(tasks, source, max_n_frac, parts, ray_address)
    elif workers <= 1:
        stream = ((task, run_task(task, source.handle, max_n_frac, str(parts))) for task in tasks)
    else:
        stream = _pool_map(tasks, source, max_n_frac, parts, workers)
    results = {}
    for task, result in stream:
        results[task.index] = result
        progress.advance(bar, task.bases)
    return results


def _default_workers(n_tasks: int) -> int:
    return max(1, min(n_tasks, len(os.sched_getaffinity(0))))


def _pool_map(tasks, source, max_n_frac, parts, workers) -> Iterator[tuple[Task, dict]]:
    # spawn, not fork: the parent may hold threads (rich, torch) that fork would copy mid-state.
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        pending = {pool.submit(run_task, t, source.handle, max_n_frac, str(parts)): t for t in tasks}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), future.result()
        finally:
            for future in pending:
                future.cancel()


def _ray_map(tasks, source, max_n_frac, parts, address) -> Iterator[tuple[Task, dict]]:
    """Fan tasks out as Ray tasks. ``parts`` must be on a filesystem every node shares."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    remote = ray.remote(num_cpus=1)(run_task)
    try:
        refs = {remote.remote(t, source.handle, max_n_frac, str(parts)): t for t in tasks}
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            task = refs.pop(done[0])
            try:
                yield task, ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, GenomeLMError):
                    raise exc.cause from None
                raise
    finally:
        if started_here:
            ray.shutdown()


def _write_splits(final, tasks, results, parts, splits, dropped, display, progress) -> dict:
    from genome_lm.engine import quiet_megatron_import

    with quiet_megatron_import():  # its builder warns about ranks when no process group exists
        return _join_parts(final, tasks, results, parts, splits, dropped, display, progress)


def _join_parts(final, tasks, results, parts, splits, dropped, display, progress) -> dict:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    bar = progress.add_task("writing", total=sum(t.bases for t in tasks), unit="bp")
    data = {}
    for split, chroms in splits.items():
        tokens_out = IndexedDatasetBuilder(str(final / f"{split}.bin"), dtype=np.uint8)
        flags_out = IndexedDatasetBuilder(str(final / f"{split}_flags.bin"), dtype=np.uint8)
        windows, skipped, n_tokens = [], [], 0
        for task in (t for t in tasks if t.split == split):
            result = results[task.index]
            tokens_path, flags_path, _ = part_paths(parts, task.index)
            with open(tokens_path, "rb") as tok_in, open(flags_path, "rb") as flag_in:
                for window in result["kept"]:
                    length = window["end"] - window["start"]
                    for builder, part in ((tokens_out, tok_in), (flags_out, flag_in)):
                        array = np.fromfile(part, dtype=np.uint8, count=length)
                        if array.size != length:
                            raise GenomeLMError(f"{tokens_path}: part file is short; delete {parts.parent} and rerun")
                        builder.add_item(torch.from_numpy(array))
                        builder.end_document()
                    n_tokens += length
            windows += result["kept"]
            skipped += result["skipped"]
            progress.advance(bar, task.bases)
        if not windows:
            raise GenomeLMError(
                f"{display}: no window of the {split} split was kept (all skipped as mostly N, or shorter than --min-tail)"
            )
        tokens_out.finalize(str(final / f"{split}.idx"))
        flags_out.finalize(str(final / f"{split}_flags.idx"))
        data[split] = {
            "prefix": split,
            "chromosomes": [asdict(c) for c in chroms],
            "n_tokens": n_tokens,
            "windows": windows,
            "skipped": skipped,
            "dropped_tails": dropped[split],
        }
    return data


def _swap_into_place(final: Path, out: Path) -> None:
    """Replace ``out`` with ``final`` so that ``out`` is never a half-written dataset."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(final, out)
    shutil.rmtree(old, ignore_errors=True)
