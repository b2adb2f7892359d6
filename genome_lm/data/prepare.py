"""`genome-lm prepare`: a genome FASTA -> tokenized windows in Megatron indexed datasets.

The work runs in four steps:

1. validate and index the FASTA (:mod:`genome_lm.data.fasta`);
2. resolve the requested chromosomes and plan windows (:mod:`genome_lm.data.windows`);
3. tokenize runs of windows ("tasks") in parallel -- local processes, or Ray tasks with
   ``ray_address`` (:mod:`genome_lm.data.shards`);
4. append each task's tokens, in task order, to one Megatron ``.bin`` per split, then write
   the ``.idx`` files (:mod:`genome_lm.data.indexed`) and the manifest
   (:mod:`genome_lm.data.manifest`).

Because step 4 writes in task order, the output is byte-identical however many workers ran
step 3, and every byte is written once (on a machine where writing costs more than
tokenizing, that is what sets the speed). Everything is built in a hidden staging folder
beside ``out`` and renamed into place at the end, so ``out`` is either a complete dataset or
absent. After an interruption, a run with the same request continues after the last task
written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

from genome_lm.data.fasta import FastaSource, open_fasta, quick_identity
from genome_lm.data.indexed import write_index
from genome_lm.data.manifest import MANIFEST, SCHEMA, Manifest, write_manifest
from genome_lm.data.names import resolve
from genome_lm.data.regions import Region, parse_region
from genome_lm.data.shards import Task, TaskResult, run_task
from genome_lm.data.tokenizer import TokenizerInfo
from genome_lm.data.windows import STUDY_WINDOW, WindowSpec, plan_windows
from genome_lm.digest import sha256_file
from genome_lm.errors import GenomeLMError
from genome_lm.progress import progress_bar

TASK_BASES = 32 << 20  # a task covers about this many bases: fine enough for progress and balance


@dataclass(frozen=True)
class PrepareRequest:
    """Everything that shapes the output (and nothing that does not, such as worker counts)."""

    fasta: Path
    out: Path
    train_chroms: tuple[str, ...] = ("chr1", "chr2")
    eval_chroms: tuple[str, ...] = ("chr22",)
    windows: WindowSpec = field(default_factory=lambda: WindowSpec(STUDY_WINDOW, STUDY_WINDOW))
    # the evaluation split's own stride (None: windows.stride): below the window, every held-out
    # base is scored at several context lengths (``eval`` then bootstraps over blocks of sequence)
    eval_stride: int | None = None

    def __post_init__(self):
        if self.eval_stride is not None and self.eval_stride < 1:
            raise ValueError(f"eval stride must be >= 1, got {self.eval_stride}")

    def split_windows(self, split: str) -> WindowSpec:
        """The window plan of ``split``: ``windows``, with ``eval_stride`` for the eval split."""
        if split == "eval" and self.eval_stride is not None:
            return replace(self.windows, stride=self.eval_stride)
        return self.windows

    def windows_json(self) -> dict:
        """The manifest's ``windows`` entry (``eval_stride`` only when set, so that older
        requests keep their key)."""
        extra = {} if self.eval_stride is None else {"eval_stride": self.eval_stride}
        return {**self.windows.as_json(), **extra}

    def key(self) -> str:
        payload = {
            "source": quick_identity(Path(self.fasta)),
            "splits": {"train": list(self.train_chroms), "eval": list(self.eval_chroms)},
            "windows": self.windows_json(),
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
    made = _missing_folders(out.resolve().parent)
    parent = _writable_parent(out)
    try:
        return _prepare_in(request, out, parent, workers, ray_address, force, quiet, cache_dir)
    except GenomeLMError:
        for folder in made:  # bad input (a region past a record's end...) leaves no empty folders behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _prepare_in(request, out, parent, workers, ray_address, force, quiet, cache_dir) -> PrepareResult:
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
            # Bad input: nothing worth resuming. (An interrupt keeps the tasks written so far.)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return PrepareResult(out, False, Manifest.load(out))


def _build(request, key, staging, out, workers, ray_address, quiet, cache_dir) -> None:
    final = staging / "final"
    final.mkdir(exist_ok=True)
    # The file's hash is only needed for the manifest: compute it beside the real work. Writing
    # also has a thread of its own, so that it overlaps tokenizing (file writes, hashing and
    # numpy's look-ups all release the GIL).
    with ThreadPoolExecutor(1) as hashing, ThreadPoolExecutor(1) as writing, progress_bar(quiet) as progress:
        sha256 = hashing.submit(sha256_file, Path(request.fasta))
        # Ray workers on other nodes read the index too: keep a built one beside the output,
        # which a cluster run must have on storage every node sees, not in this node's cache.
        index_dir = staging / "index" if ray_address else cache_dir
        source = _open_source(Path(request.fasta), staging, index_dir, progress)
        splits = _resolve_splits(request, source)
        tasks, dropped = _plan_tasks(splits, request)
        writer = _SplitWriter(final, staging / "done")
        todo = tasks[writer.next_task :]
        bar = progress.add_task("tokenizing", total=sum(t.bases for t in tasks), unit="bp")
        progress.advance(bar, sum(t.bases for t in tasks[: writer.next_task]))
        args = (source.handle, request.windows.max_n_fraction)
        written = None
        for task, result in zip(todo, _results_in_order(todo, args, workers, ray_address)):
            if written is not None:
                written.result()  # one task in flight: memory stays bounded, order is kept
            written = writing.submit(writer.write, task, result)
            written.add_done_callback(lambda _, bases=task.bases: progress.advance(bar, bases))
        if written is not None:
            written.result()
        split_data = writer.finish(splits, dropped, source.handle.display)
    manifest = {
        "schema": SCHEMA,
        "request_key": key,
        "source": {**source.identity, "sha256": sha256.result(), "records": [asdict(r) for r in source.records]},
        "tokenizer": TokenizerInfo().to_json(),
        "windows": request.windows_json(),
        "splits": split_data,
    }
    write_manifest(final, manifest)
    _swap_into_place(final, out)


def _check_splits(request: PrepareRequest) -> None:
    if not request.train_chroms and not request.eval_chroms:
        raise GenomeLMError("no chromosomes requested: give --train-chroms and/or --eval-chroms")
    for name in (*request.train_chroms, *request.eval_chroms):
        parse_region(name)  # a malformed region fails here, before any work
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
    """A requested chromosome or region (``regions``): its record, the record's length, and the
    part of it to cut into windows, 0-based half-open (the whole record unless a region)."""

    requested: str
    record: str
    length: int
    start: int
    end: int


def _resolve_splits(request: PrepareRequest, source: FastaSource) -> dict[str, list[_Chrom]]:
    names = source.names()
    display = source.handle.display
    splits: dict[str, list[_Chrom]] = {}
    seen: list[tuple[str, Region, str]] = []  # (split, bounded region on its record, as requested)
    for split, requested in (("train", request.train_chroms), ("eval", request.eval_chroms)):
        if not requested:
            continue
        chroms = []
        for name in requested:
            region = parse_region(name, names)
            record = resolve(region.name, names, display)
            part = Region(record, region.start, region.end).bounded(source.length(record), display)
            for other_split, other, other_name in seen:
                if other.name == record and other.overlaps(part):
                    where = "both in " + split if other_split == split else f"{other_split} and {split}"
                    raise GenomeLMError(f"{display}: {other_name!r} and {name!r} overlap on record {record!r} "
                                        f"({where}): bases {max(other.start, part.start) + 1:,}-"
                                        f"{min(other.end, part.end):,} would be in both")
            seen.append((split, part, name))
            chroms.append(_Chrom(name, record, source.length(record), part.start, part.end))
        splits[split] = chroms
    return splits


def _plan_tasks(splits: dict[str, list[_Chrom]], request: PrepareRequest) -> tuple[list[Task], dict[str, list]]:
    per_task = max(1, TASK_BASES // request.windows.window)
    tasks: list[Task] = []
    dropped: dict[str, list] = {split: [] for split in splits}
    for split, chroms in splits.items():
        spec = request.split_windows(split)
        for chrom in chroms:
            windows, tail = plan_windows(chrom.end - chrom.start, spec)
            windows = [(chrom.start + a, chrom.start + b) for a, b in windows]
            if tail is not None:
                dropped[split].append({"chrom": chrom.record, "start": chrom.start + tail[0],
                                       "end": chrom.start + tail[1]})
            for i in range(0, len(windows), per_task):
                tasks.append(Task(len(tasks), split, chrom.record, tuple(windows[i : i + per_task])))
    return tasks, dropped


def _default_workers(n_tasks: int) -> int:
    """One worker per core but one: this process writes the output and hashes the input."""
    return max(1, min(n_tasks, len(os.sched_getaffinity(0)) - 1))


def _results_in_order(tasks: list[Task], args: tuple, workers: int | None, ray_address: str | None):
    """Run ``run_task(task, *args)`` for each task and yield the results in task order.

    At most a few tasks run ahead of the one being written, so memory stays bounded however
    large the genome: the results waiting to be written are at most ``lookahead`` tasks.
    """
    workers = workers or _default_workers(len(tasks))
    if ray_address is not None:
        yield from _ray_in_order(tasks, args, ray_address)
    elif workers <= 1:
        for task in tasks:
            yield run_task(task, *args)
    else:
        yield from _pool_in_order(tasks, args, workers)


def _pool_in_order(tasks, args, workers):
    lookahead = 2 * workers
    # spawn, not fork: the parent may hold threads (rich, hashing) that fork would copy mid-state.
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures: dict[int, object] = {}
        try:
            for i in range(len(tasks)):
                for j in range(len(futures) + i, min(len(tasks), i + lookahead)):
                    futures[j] = pool.submit(run_task, tasks[j], *args)
                yield futures.pop(i).result()
        finally:
            pool.shutdown(cancel_futures=True)


def _ray_in_order(tasks, args, address):
    """Ray tasks on a cluster; results travel back through Ray's object store to this process,
    which writes them, so only the FASTA and its index need to be visible to every node."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    remote = ray.remote(num_cpus=1)(run_task)
    lookahead = max(2, min(16, 2 * int(ray.cluster_resources().get("CPU", 1))))
    refs: dict[int, object] = {}
    try:
        for i in range(len(tasks)):
            for j in range(len(refs) + i, min(len(tasks), i + lookahead)):
                refs[j] = remote.remote(tasks[j], *args)
            try:
                yield ray.get(refs.pop(i))
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, GenomeLMError):
                    raise exc.cause from None
                raise
    finally:
        for ref in refs.values():
            ray.cancel(ref)
        if started_here:
            ray.shutdown()


class _SplitWriter:
    """Appends task results, in task order, to each split's .bin files.

    After each task it records what it wrote in ``done/<task>.json``; a later run with the same
    request truncates the files to what was recorded and continues with the next task.
    """

    def __init__(self, folder: Path, done: Path):
        self.folder, self.done = folder, done
        done.mkdir(exist_ok=True)
        self.records: list[dict] = []
        while (path := done / f"{len(self.records):06d}.json").exists():
            self.records.append(json.loads(path.read_text()))
        self.next_task = len(self.records)
        self.sizes: dict[str, list[int]] = {}
        for record in self.records:
            sizes = self.sizes.setdefault(record["split"], [0, 0])
            sizes[0] += record["token_bytes"]
            sizes[1] += record["mask_bytes"]
        self._split = None
        self._files = None

    def _paths(self, split: str) -> tuple[Path, Path]:
        return self.folder / f"{split}.bin", self.folder / f"{split}_softmask.bin"

    def _open(self, split: str) -> tuple:
        if self._split != split:
            self._close()
            sizes = self.sizes.setdefault(split, [0, 0])
            files = []
            for path, size in zip(self._paths(split), sizes):
                handle = open(path, "r+b" if path.exists() else "wb")
                handle.truncate(size)  # drop anything written after the last recorded task
                handle.seek(size)
                files.append(handle)
            self._split, self._files = split, tuple(files)
        return self._files

    def _close(self) -> None:
        for handle in self._files or ():
            handle.close()
        self._split = self._files = None

    def write(self, task: Task, result: TaskResult) -> None:
        files = self._open(task.split)
        sizes = []
        for handle, arrays in zip(files, (result.tokens, result.softmask)):
            for array in arrays:
                handle.write(array.data)
            handle.flush()
            sizes.append(sum(array.nbytes for array in arrays))
        record = {"split": task.split, "kept": result.kept, "skipped": result.skipped,
                  "token_bytes": sizes[0], "mask_bytes": sizes[1]}
        sizes = self.sizes[task.split]
        sizes[0] += record["token_bytes"]
        sizes[1] += record["mask_bytes"]
        path = self.done / f"{task.index:06d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
        self.records.append(record)

    def finish(self, splits: dict, dropped: dict, display: str) -> dict:
        """Write each split's .idx files; return the manifest's ``splits`` section."""
        self._close()
        data = {}
        for split, chroms in splits.items():
            records = [r for r in self.records if r["split"] == split]
            windows = [w for r in records for w in r["kept"]]
            if not windows:
                raise GenomeLMError(
                    f"{display}: no window of the {split} split was kept "
                    "(all skipped as mostly N, or shorter than --min-tail)"
                )
            lengths = [w["end"] - w["start"] for w in windows]
            write_index(self.folder / f"{split}.idx", lengths)
            write_index(self.folder / f"{split}_softmask.idx", [(n + 7) // 8 for n in lengths])
            data[split] = {
                "prefix": split,
                "chromosomes": [asdict(c) for c in chroms],
                "n_tokens": sum(lengths),
                "windows": windows,
                "skipped": [w for r in records for w in r["skipped"]],
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
