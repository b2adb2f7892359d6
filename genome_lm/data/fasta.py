"""Reading genome FASTA files: plain, gzip or BGZF, one or many records.

Random access goes through htslib's faidx (pysam): an existing ``.fai`` (and ``.gzi`` for BGZF)
beside the input is used as it is; otherwise one is built into the cache folder, never into the
user's data folder. A plain-gzip file cannot be indexed, so it is decompressed once into the
run's work folder (one streaming pass, constant memory) and indexed there.

htslib is lenient where a training set must not be: it silently drops a duplicated record name
or a record with no sequence. So before indexing, :func:`open_fasta` makes one streaming pass
over the (decompressed) bytes that checks the header structure and detects truncated gzip
streams. ``genome_lm.digest.sha256_file`` gives the file's identity for the manifest. Sequence letters are checked
later, window by window, by the tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pysam

from genome_lm.errors import GenomeLMError

CHUNK = 16 << 20
_NON_BLANK = re.compile(rb"\S")
BGZF_EOF = bytes.fromhex("1f8b08040000000000ff0600424302001b0003000000000000000000")


@dataclass(frozen=True)
class Record:
    name: str
    length: int


def sniff(path: Path) -> str:
    """``"plain"``, ``"gzip"`` or ``"bgzf"`` from the file's first bytes."""
    with open(path, "rb") as fh:
        head = fh.read(18)
    if head[:2] != b"\x1f\x8b":
        return "plain"
    # BGZF is gzip with an extra field holding the 'BC' subfield (SAM spec, section 4.1).
    if len(head) >= 14 and head[3] & 4 and head[12:14] == b"BC":
        return "bgzf"
    return "gzip"


def _raw_chunks(path: Path, on_bytes=None) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            if on_bytes:
                on_bytes(len(chunk))
            yield chunk


def _decompressed(path: Path, compression: str, on_bytes=None) -> Iterator[bytes]:
    """The file's content, decompressed, in chunks; multi-member gzip (BGZF) included."""
    if compression == "plain":
        yield from _raw_chunks(path, on_bytes)
        return
    inflater, fed = zlib.decompressobj(wbits=31), False
    for chunk in _raw_chunks(path, on_bytes):
        while chunk:
            fed = True
            try:
                out = inflater.decompress(chunk)
            except zlib.error as exc:
                raise GenomeLMError(f"{path}: corrupt gzip data ({exc})") from None
            if out:
                yield out
            chunk = b""
            if inflater.eof:  # the next gzip member (BGZF is one member per 64 KiB block)
                chunk = inflater.unused_data
                inflater, fed = zlib.decompressobj(wbits=31), False
    if fed:
        raise GenomeLMError(f"{path}: truncated gzip file (the compressed stream ends early)")


class _HeaderScanner:
    """Finds header lines in a stream of chunks and checks the structure around them.

    Only header lines are looked at (sequence lines may be hundreds of Mbp long), so the scan
    runs at memchr speed. Positions are kept as byte offsets; ``line_of(offset)`` turns one
    into a line number, which costs a second pass and so happens only for an error message.
    """

    def __init__(self, path: Path, line_of):
        self.path = path
        self.line_of = line_of
        self.headers: list[tuple[str, int]] = []  # (name, byte offset of its '>')
        self._seen: dict[str, int] = {}
        self._offset = 0  # bytes before the current chunk
        self._at_line_start = True
        self._started = False  # saw the first non-blank byte
        self._pending = b""  # a header line cut by the chunk boundary
        self._pending_at = 0
        self._has_sequence = True  # the current record has a non-blank sequence byte

    def feed(self, chunk: bytes) -> None:
        pos = 0
        if self._pending:
            end = chunk.find(b"\n")
            self._pending += chunk if end < 0 else chunk[:end]
            if len(self._pending) > 1 << 20:
                self._fail("header on line {} is longer than 1 MiB", self._pending_at)
            if end >= 0:
                self._header(self._pending, self._pending_at)
                self._pending = b""
            pos = len(chunk) if end < 0 else end
        if not self._started:
            first = len(chunk) - len(chunk.lstrip())
            if first < len(chunk):
                self._started = True
                if chunk[first : first + 1] != b">":
                    self._not_fasta(chunk[first:], self._offset + first)
        start = self._next_header(chunk, pos)
        while start >= 0:
            self._has_sequence |= _NON_BLANK.search(chunk, pos, start) is not None
            end = chunk.find(b"\n", start)
            if end < 0:
                self._pending, self._pending_at = chunk[start:], self._offset + start
                pos = len(chunk)
                break
            self._header(chunk[start:end], self._offset + start)
            pos = end
            start = self._next_header(chunk, end)
        if self._started:
            self._has_sequence |= _NON_BLANK.search(chunk, pos) is not None
        self._offset += len(chunk)
        if chunk:
            self._at_line_start = chunk.endswith(b"\n")

    def _next_header(self, chunk: bytes, pos: int) -> int:
        """Index of the next '>' at a line start, or -1. Searching for the rare '>' alone runs
        at memchr speed; a two-byte pattern would stop at every newline."""
        while (pos := chunk.find(b">", pos)) >= 0:
            if (chunk[pos - 1] == 10) if pos else self._at_line_start:  # 10 == ord("\n")
                return pos
            pos += 1  # a '>' inside a sequence line: the tokenizer reports it
        return -1

    def _header(self, line: bytes, offset: int) -> None:
        if not self._has_sequence:
            self._no_sequence()
        self._has_sequence = False
        fields = line[1:].split(maxsplit=1)
        if not fields or line[1:2].isspace():  # htslib, like most tools, names a record by its first word
            self._fail("header on line {} has no name", offset)
        try:
            name = fields[0].decode("ascii")
        except UnicodeDecodeError:
            self._fail("header on line {} has a non-ASCII name", offset)
        if name in self._seen:
            first = self.line_of(self._seen[name])
            self._fail(f"duplicate record name {name!r} (lines {first} and {{}})", offset)
        self._seen[name] = offset
        self.headers.append((name, offset))

    def _fail(self, message: str, offset: int):
        raise GenomeLMError(f"{self.path}: " + message.format(self.line_of(offset)))

    def _no_sequence(self):
        name, offset = self.headers[-1]
        self._fail(f"record {name!r} (line {{}}) has no sequence", offset)

    def _not_fasta(self, text: bytes, offset: int) -> None:
        first_line = text.split(b"\n", 1)[0].strip()
        if first_line.isalpha() and first_line.isascii() and b"\n>" in text:
            self._fail("sequence before the first header (line {})", offset)
        self._fail("not a FASTA file (line {} does not start with '>')", offset)

    def finish(self) -> None:
        if self._pending:
            self._header(self._pending.rstrip(b"\r"), self._pending_at)
        if not self._started:
            raise GenomeLMError(f"{self.path}: empty file")
        if not self._has_sequence:
            self._no_sequence()


@dataclass(frozen=True)
class FastaHandle:
    """What a worker process needs to read sequence; small and picklable."""

    display: str  # the user's path, for messages
    seq_path: str  # the file htslib reads: the input, or its decompressed copy
    fai_path: str
    gzi_path: str | None

    def open(self) -> pysam.FastaFile:
        return pysam.FastaFile(self.seq_path, filepath_index=self.fai_path, filepath_index_compressed=self.gzi_path)


def fetch_bytes(fasta: pysam.FastaFile, handle: FastaHandle, name: str, start: int, end: int) -> bytes:
    """Bases ``[start, end)`` of record ``name`` as raw ASCII bytes (newlines removed, case kept)."""
    try:
        text = fasta.fetch(reference=name, start=start, end=end)
    except UnicodeDecodeError as exc:
        pos = start + exc.start + 1
        raise GenomeLMError(
            f"{handle.display}: record {name!r} position {pos}: invalid character byte 0x{exc.object[exc.start]:02x}"
        ) from None
    except (OSError, ValueError) as exc:
        raise GenomeLMError(f"{handle.display}: cannot read {name}:{start + 1}-{end} ({exc})") from None
    if len(text) != end - start:
        raise GenomeLMError(f"{handle.display}: record {name!r} ends early at {start + len(text)} (file truncated?)")
    return text.encode("ascii")


@dataclass(frozen=True)
class FastaSource:
    """A validated, indexed FASTA: its records in file order and how to read them."""

    path: Path
    compression: str
    records: tuple[Record, ...]
    handle: FastaHandle
    identity: dict

    def names(self) -> list[str]:
        return [r.name for r in self.records]

    def length(self, name: str) -> int:
        return next(r.length for r in self.records if r.name == name)


def quick_identity(path: Path) -> dict:
    """Path, size and modification time: enough to tell whether a finished output is current."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def check_readable(path: Path) -> None:
    """A one-line error unless ``path`` is a regular file this process can read."""
    if not path.exists():
        raise GenomeLMError(f"{path}: no such file")
    if not path.is_file():
        raise GenomeLMError(f"{path}: not a regular file")
    if not os.access(path, os.R_OK):
        raise GenomeLMError(f"{path}: permission denied")


def open_fasta(path: Path, work_dir: Path, cache_dir: Path, on_bytes=None) -> FastaSource:
    """Validate ``path``, index it (reusing an index beside it) and return a :class:`FastaSource`.

    ``work_dir`` receives the decompressed copy of a plain-gzip input; ``cache_dir`` receives
    indexes built for plain or BGZF inputs that have none. ``on_bytes(n)`` reports progress of
    the validation pass in input bytes.
    """
    path = Path(path)
    check_readable(path)
    compression = sniff(path)
    if compression == "bgzf":
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - len(BGZF_EOF)))
            if fh.read() != BGZF_EOF:
                raise GenomeLMError(f"{path}: truncated BGZF file (no end-of-file marker)")

    def line_of(offset: int) -> int:  # 1-based line of a byte offset; for error messages only
        newlines, seen = 0, 0
        for chunk in _decompressed(path, compression):
            newlines += chunk.count(b"\n", 0, max(0, offset - seen))
            seen += len(chunk)
            if seen >= offset:
                break
        return newlines + 1

    scanner = _HeaderScanner(path, line_of)
    copy_path = work_dir / (path.name.removesuffix(".gz") + ".decompressed.fa")
    with _atomic_file(copy_path) if compression == "gzip" else contextlib.nullcontext() as copy:
        for chunk in _decompressed(path, compression, on_bytes):
            scanner.feed(chunk)
            if copy is not None:
                copy.write(chunk)
        scanner.finish()

    if compression == "gzip":
        seq_path, fai, gzi = copy_path, Path(str(copy_path) + ".fai"), None
        _build_index(path, seq_path, fai, None)
    else:
        seq_path = path
        fai, gzi = _existing_index(path, compression)
        if fai is None:
            key = hashlib.sha256(repr(sorted(quick_identity(path).items())).encode()).hexdigest()[:16]
            folder = cache_dir / "faidx" / key
            fai = folder / (path.name + ".fai")
            gzi = folder / (path.name + ".gzi") if compression == "bgzf" else None
            if not (fai.exists() and (gzi is None or gzi.exists())):
                folder.mkdir(parents=True, exist_ok=True)
                _build_index(path, seq_path, fai, gzi)

    records = _read_fai(path, fai)
    indexed = {r.name for r in records}
    for name, offset in scanner.headers:
        if name not in indexed:
            raise GenomeLMError(f"{path}: record {name!r} (line {line_of(offset)}) has no sequence")
    if [r.name for r in records] != [name for name, _ in scanner.headers]:
        raise GenomeLMError(f"{path}: the index {fai} does not match the file; delete it and run again")
    handle = FastaHandle(str(path), str(seq_path), str(fai), str(gzi) if gzi else None)
    identity = {**quick_identity(path), "compression": compression}
    return FastaSource(path, compression, tuple(records), handle, identity)


def _existing_index(path: Path, compression: str) -> tuple[Path | None, Path | None]:
    fai = Path(str(path) + ".fai")
    gzi = Path(str(path) + ".gzi") if compression == "bgzf" else None
    mtime = path.stat().st_mtime_ns
    for index in (fai, gzi):
        if index is not None and not (index.exists() and index.stat().st_mtime_ns >= mtime):
            return None, None
    return fai, gzi


def _build_index(display: Path, seq_path: Path, fai: Path, gzi: Path | None) -> None:
    """Build ``fai`` (and ``gzi``) with htslib, atomically; its complaint becomes our error."""
    tmp_fai = fai.with_name(fai.name + f".tmp{os.getpid()}")
    tmp_gzi = gzi.with_name(gzi.name + f".tmp{os.getpid()}") if gzi else None
    args = [str(seq_path), "--fai-idx", str(tmp_fai)] + (["--gzi-idx", str(tmp_gzi)] if tmp_gzi else [])
    with _captured_stderr() as messages:
        try:
            pysam.faidx(*args)
            failed = None
        except pysam.SamtoolsError as exc:
            failed = exc
    if failed is not None:
        for tmp in (tmp_fai, tmp_gzi):
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        detail = _htslib_message(messages.text) or str(failed)
        raise GenomeLMError(f"{display}: cannot index: {detail}")
    if tmp_gzi is not None:
        os.replace(tmp_gzi, gzi)
    os.replace(tmp_fai, fai)


def _htslib_message(text: str) -> str:
    lines = [line.split("] ", 1)[-1] for line in text.splitlines() if line.startswith("[E::")]
    detail = "; ".join(lines)
    if "Different line length" in detail:
        detail += " (lines within a record must all have the same width; rewrap the file, e.g. `seqkit seq -w 60`)"
    return detail


def _read_fai(display: Path, fai: Path) -> list[Record]:
    records = []
    for line in fai.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 5 or not fields[1].isdigit():
            raise GenomeLMError(f"{display}: malformed index {fai}; delete it and run again")
        records.append(Record(fields[0], int(fields[1])))
    return records


class _Captured:
    text = ""


@contextlib.contextmanager
def _captured_stderr():
    """Capture what C code (htslib) writes to file descriptor 2."""
    captured = _Captured()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.text = tmp.read().decode(errors="replace")


@contextlib.contextmanager
def _atomic_file(path: Path):
    """Write to a temporary name beside ``path``; rename into place only on success."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            yield fh
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
