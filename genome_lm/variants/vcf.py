"""Variants from a VCF, checked against the reference FASTA and cut into sequence windows.

A DNA language model scores a variant zero-shot by comparing its likelihood of the alternative
window with that of the reference window around the variant. That comparison means something
only when the VCF and the FASTA describe the same assembly and the window is real sequence, so
:func:`read_variants` keeps a variant only if its REF matches the FASTA and its window lies
inside the record with no N. Everything else is listed among the skipped variants with the
reason, never dropped silently; ``strict=True`` turns any skip into an error.

Multi-allelic records become one :class:`Variant` per ALT. Chromosome names are matched across
conventions (``17`` / ``chr17``, ``MT`` / ``chrM``) as :mod:`genome_lm.data.names` does.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import pysam

from genome_lm.data.fasta import (  # open_fasta's indexing, not its scan
    FastaHandle,
    _build_index,
    _existing_index,
    _read_fai,
    check_readable,
    fetch_bytes,
    quick_identity,
    sniff,
)
from genome_lm.data.names import canonical
from genome_lm.errors import GenomeLMError

_BASES = re.compile(r"^[ACGT]+$", re.IGNORECASE)
_NOT_BASE = re.compile(r"[^ACGT]")


@dataclass(frozen=True)
class Variant:
    """One ALT allele of a VCF record, placed on a FASTA record.

    ``ref`` and ``alt`` are as written in the VCF. The derived coordinates describe the bases
    the ALT actually changes: the bases REF and ALT share at the start (the anchor base of a
    VCF indel), and then at the end, are trimmed off, so a SNV has ``start = pos - 1`` and an
    insertion has ``start == end``.
    """

    chrom: str  # as in the VCF
    contig: str  # the FASTA record it maps to
    pos: int  # 1-based VCF POS
    ref: str
    alt: str
    id: str | None = None
    info: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.ref.upper() == self.alt.upper():
            raise ValueError(f"{self.key}: ALT equals REF")

    @cached_property
    def _trimmed(self) -> tuple[int, str, str]:
        ref, alt = self.ref.upper(), self.alt.upper()
        lead = 0
        while lead < min(len(ref), len(alt)) and ref[lead] == alt[lead]:
            lead += 1
        ref, alt = ref[lead:], alt[lead:]
        tail = 0
        while tail < min(len(ref), len(alt)) and ref[-1 - tail] == alt[-1 - tail]:
            tail += 1
        return self.pos - 1 + lead, ref[: len(ref) - tail], alt[: len(alt) - tail]

    @property
    def start(self) -> int:
        """0-based position of the first REF base the ALT changes (or inserts before)."""
        return self._trimmed[0]

    @property
    def end(self) -> int:
        """0-based exclusive end of the changed REF bases (``start`` for an insertion)."""
        return self.start + len(self.ref_allele)

    @property
    def ref_allele(self) -> str:
        """The changed REF bases, uppercase; empty for an insertion."""
        return self._trimmed[1]

    @property
    def alt_allele(self) -> str:
        """The bases that replace them, uppercase; empty for a deletion."""
        return self._trimmed[2]

    @property
    def kind(self) -> str:
        """``snv``, ``insertion``, ``deletion``, ``mnv`` (equal lengths, several bases) or ``complex``."""
        r, a = len(self.ref_allele), len(self.alt_allele)
        if r == a:
            return "snv" if r == 1 else "mnv"
        if r == 0:
            return "insertion"
        if a == 0:
            return "deletion"
        return "complex"

    @property
    def key(self) -> str:
        """``chrom:pos:ref>alt`` as in the VCF: stable across runs, for joining scores to variants."""
        return _key(self.chrom, self.pos, self.ref, self.alt)


@dataclass(frozen=True)
class Skipped:
    """A VCF allele that was not kept, and why. ``key`` and ``reason`` are what it is compared
    by; the record's fields, for the list of skipped variants, are what the key already names
    (and the ID)."""

    key: str
    reason: str
    chrom: str = field(default="", compare=False)
    pos: int = field(default=0, compare=False)
    ref: str = field(default="", compare=False)
    alt: str = field(default="", compare=False)
    id: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class VariantSet:
    """What :func:`read_variants` kept and skipped; ``labels`` (1/0, aligned with ``variants``)
    only when a label field was asked for."""

    variants: list[Variant]
    skipped: list[Skipped]
    labels: list[int] | None = None


def _key(chrom: str, pos: int, ref: str, alt: str) -> str:
    return f"{chrom}:{pos}:{ref}>{alt}"


def default_cache_dir() -> Path:
    """Where indexes for FASTA files without one go (the same place ``prepare`` uses)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "genome-lm"


class Reference:
    """An indexed FASTA, opened once for many small reads; sequence comes back uppercase.

    An up-to-date index beside the file (``.fai``, and ``.gzi`` for bgzip) is used as it is. A
    plain or bgzip FASTA without one is indexed by htslib into the cache folder
    (``$XDG_CACHE_HOME/genome-lm/faidx``, shared with ``prepare``), never beside the user's data,
    so a read-only data folder is fine. A plain-gzip FASTA cannot be read at random positions:
    that is an error asking for ``bgzip``. So is a file htslib cannot index (e.g. uneven lines).
    """

    def __init__(self, path: str | Path, cache_dir: Path | None = None):
        self.path = Path(path)
        check_readable(self.path)
        compression = sniff(self.path)
        if compression == "gzip":
            raise GenomeLMError(
                f"{self.path}: a plain-gzip FASTA cannot be indexed; "
                "recompress it with `bgzip` (htslib) or decompress it"
            )
        fai, gzi = _existing_index(self.path, compression)
        if fai is None:
            fai, gzi = self._index_in_cache(compression, cache_dir or default_cache_dir())
        self.lengths: dict[str, int] = {r.name: r.length for r in _read_fai(self.path, fai)}
        self._handle = FastaHandle(str(self.path), str(self.path), str(fai), str(gzi) if gzi else None)
        try:
            self._fasta = self._handle.open()
        except (OSError, ValueError) as exc:
            raise GenomeLMError(f"{self.path}: cannot open ({exc})") from None
        self._by_key: dict[str, list[str]] = {}
        for name in self.lengths:
            self._by_key.setdefault(canonical(name), []).append(name)

    def _index_in_cache(self, compression: str, cache_dir: Path) -> tuple[Path, Path | None]:
        # the same folder open_fasta uses, so `prepare` and `variants` share one index per file
        key = hashlib.sha256(repr(sorted(quick_identity(self.path).items())).encode()).hexdigest()[:16]
        folder = cache_dir / "faidx" / key
        fai = folder / (self.path.name + ".fai")
        gzi = folder / (self.path.name + ".gzi") if compression == "bgzf" else None
        if not (fai.exists() and (gzi is None or gzi.exists())):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise GenomeLMError(f"{self.path}: not indexed, and cannot write one to {folder} ({exc})") from None
            _build_index(self.path, self.path, fai, gzi)
        return fai, gzi

    def contig(self, chrom: str) -> str | None:
        """The record ``chrom`` refers to (exact name first, then 17 = chr17, MT = chrM, ...), or None."""
        if chrom in self.lengths:
            return chrom
        matches = self._by_key.get(canonical(chrom), [])
        if len(matches) > 1:
            raise GenomeLMError(f"{self.path}: chromosome {chrom!r} is ambiguous: matches {', '.join(matches)}")
        return matches[0] if matches else None

    def fetch(self, contig: str, start: int, end: int) -> str:
        """Bases ``[start, end)`` of record ``contig``, uppercase (the FASTA may be soft-masked)."""
        return fetch_bytes(self._fasta, self._handle, contig, start, end).decode("ascii").upper()

    def close(self) -> None:
        self._fasta.close()

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def windows(variant: Variant, fasta: Reference, left: int, right: int) -> tuple[str, str, int]:
    """(reference window, alternative window, offset of ``variant.start`` in both), uppercase.

    The reference window is ``[start - left, end + right)``; the alternative one has the same
    flanks around ``alt_allele``, so the two differ in length by an indel's size.
    """
    length = fasta.lengths.get(variant.contig)
    lo, hi = variant.start - left, variant.end + right
    if length is None or lo < 0 or hi > length:
        raise GenomeLMError(f"{fasta.path}: {variant.key}: window [{lo}, {hi}) is not inside record {variant.contig!r}")
    ref = fasta.fetch(variant.contig, lo, hi)
    alt = ref[:left] + variant.alt_allele + ref[left + len(variant.ref_allele) :]
    return ref, alt, left


def read_variants(
    vcf_path: str | Path,
    fasta_path: str | Path,
    *,
    left: int,
    right: int,
    max_indel: int = 50,
    strict: bool = False,
    label: str | None = None,
    positive: Iterable[str] = (),
    negative: Iterable[str] | None = None,
) -> VariantSet:
    """Read every ALT allele of ``vcf_path`` and keep those that can be scored with windows of
    ``left`` bases before ``start`` and ``right`` bases after ``end`` in ``fasta_path``.

    Skipped (with the reason): symbolic and breakend ALTs (``<DEL>``, ``*``, ``A[1:5[``), ALTs
    that are not A/C/G/T, changes longer than ``max_indel`` bases, chromosomes the FASTA does
    not have, REF not matching the FASTA (case-insensitive), windows running off the record or
    into N. With ``strict`` the first skip is an error instead.

    With ``label`` (an INFO field) a variant is positive (1) when its value, compared as text
    case-insensitively, is in ``positive``, negative (0) when it is in ``negative`` or, with
    ``negative=None``, when it has any other value; variants without a value (or, with an
    explicit ``negative``, with a value in neither list) are skipped.

    The FASTA is opened as :class:`Reference` describes (a FASTA without index is indexed into
    the cache folder). Errors (:class:`GenomeLMError`): a missing file, a FASTA that cannot be
    indexed, a ``label`` the VCF header does not declare, and VCF chromosomes none of which is
    in the FASTA.
    """
    vcf_path = Path(vcf_path)
    if left < 0 or right < 0:
        raise ValueError(f"left and right must be >= 0 (got {left}, {right})")
    check_readable(vcf_path)
    with Reference(fasta_path) as fasta, _open_vcf(vcf_path) as vcf:
        labeller = _Labeller(vcf_path, vcf.header, label, positive, negative) if label is not None else None
        flags = [key for key, meta in vcf.header.info.items() if meta.type == "Flag"]
        variants: list[Variant] = []
        skipped: list[Skipped] = []
        labels: list[int] = []
        contigs: dict[str, str | None] = {}
        unknown: set[str] = set()
        placeable = False

        def skip(record: pysam.VariantRecord, alt: str, reason: str) -> None:
            key = _key(record.chrom, record.pos, record.ref, alt)
            if strict:
                raise GenomeLMError(f"{vcf_path}: variant {key}: {reason}")
            skipped.append(Skipped(key, reason, chrom=record.chrom, pos=record.pos, ref=record.ref, alt=alt,
                                   id=record.id))

        for record in _records(vcf_path, vcf):
            chrom, pos, ref = record.chrom, record.pos, record.ref
            alts = record.alts or ()
            if not alts:
                skip(record, ".", "no ALT")
                continue
            if chrom not in contigs:
                contigs[chrom] = fasta.contig(chrom)
            contig = contigs[chrom]
            for index, alt in enumerate(alts):
                if contig is None:
                    unknown.add(chrom)
                    skip(record, alt, f"chromosome {chrom} not in the FASTA")
                    continue
                placeable = True
                if reason := _allele_problem(ref, alt):
                    skip(record, alt, reason)
                    continue
                info = _info_for(record, index, flags)
                variant = Variant(chrom, contig, pos, ref, alt, record.id, info)
                if reason := _placement_problem(variant, fasta, left, right, max_indel):
                    skip(record, alt, reason)
                    continue
                if labeller is not None:
                    value = labeller(variant)
                    if isinstance(value, str):
                        skip(record, alt, value)
                        continue
                    labels.append(value)
                variants.append(variant)
        if unknown and not placeable:
            present = list(fasta.lengths)
            shown = ", ".join(present[:10]) + (f", ... ({len(present) - 10} more)" if len(present) > 10 else "")
            raise GenomeLMError(
                f"{vcf_path}: none of its chromosomes ({', '.join(sorted(unknown))}) is in {fasta.path} "
                f"(records: {shown}); is it the right assembly?"
            )
    return VariantSet(variants, skipped, labels if labeller is not None else None)


def _open_vcf(path: Path) -> pysam.VariantFile:
    try:
        return pysam.VariantFile(str(path))
    except (OSError, ValueError) as exc:
        raise GenomeLMError(f"{path}: cannot read as VCF ({exc})") from None


def _records(path: Path, vcf: pysam.VariantFile) -> Iterable[pysam.VariantRecord]:
    """The records, with htslib's complaints about a malformed line as our one-line error."""
    it = iter(vcf)
    while True:
        try:
            record = next(it)
        except StopIteration:
            return
        except (OSError, ValueError) as exc:
            raise GenomeLMError(f"{path}: cannot read a record ({exc})") from None
        yield record


def _allele_problem(ref: str, alt: str) -> str | None:
    if alt.startswith("<") or alt == "*" or "[" in alt or "]" in alt or alt.startswith(".") or alt.endswith("."):
        return "symbolic or breakend ALT"
    if not _BASES.match(alt):
        return f"ALT {alt} is not A/C/G/T"
    if not _BASES.match(ref):
        return f"REF {ref} is not A/C/G/T"
    if ref.upper() == alt.upper():
        return "ALT equals REF"
    return None


def _info_for(record: pysam.VariantRecord, allele: int, flags: list[str]) -> dict[str, Any]:
    """INFO for one ALT: Number=A fields give this allele's value, Number=R (REF's, this ALT's);
    scalars as they are, declared flags as bool (False when absent), other lists as tuples."""
    info: dict[str, Any] = {key: False for key in flags}
    header = record.header.info
    for key, value in record.info.items():
        meta = header.get(key)
        number = meta.number if meta is not None else "."
        if isinstance(value, tuple):
            if number == "A" and len(value) > allele:
                value = value[allele]
            elif number == "R" and len(value) > allele + 1:
                value = (value[0], value[allele + 1])
        elif meta is not None and meta.type == "Flag":
            value = bool(value)
        info[key] = value
    return info


def _placement_problem(variant: Variant, fasta: Reference, left: int, right: int, max_indel: int) -> str | None:
    """Why ``variant`` cannot be scored with this window, or None."""
    kind = variant.kind
    size = max(len(variant.ref_allele), len(variant.alt_allele))
    if kind != "snv" and size > max_indel:
        name = "indel" if kind in ("insertion", "deletion") else kind
        return f"{name} longer than {max_indel} ({size} bases)"
    length = fasta.lengths[variant.contig]
    lo, hi = variant.start - left, variant.end + right
    ref_lo, ref_hi = variant.pos - 1, variant.pos - 1 + len(variant.ref)
    if lo < 0:
        return "window runs off the record's start"
    if max(hi, ref_hi) > length:
        return "window runs off the record's end"
    a, b = min(lo, ref_lo), max(hi, ref_hi)
    text = fasta.fetch(variant.contig, a, b)
    found = text[ref_lo - a : ref_hi - a]
    if found != variant.ref.upper():
        return f"REF does not match the FASTA ({found} at {variant.contig}:{variant.pos})"
    window = text[lo - a : hi - a]
    if bad := _NOT_BASE.search(window):
        return "window runs into N" if bad.group() == "N" else f"window contains {bad.group()}"
    return None


class _Labeller:
    """Turns a variant's INFO[label] into 1, 0, or the reason it has no label."""

    def __init__(
        self, vcf_path: Path, header: pysam.VariantHeader, label: str, positive: Iterable[str], negative
    ) -> None:
        if label not in header.info:
            declared = ", ".join(header.info) or "none"
            raise GenomeLMError(f"{vcf_path}: no INFO field {label!r} in the header (declared: {declared})")
        self.label = label
        self.positive = {str(v).lower() for v in positive}
        self.negative = None if negative is None else {str(v).lower() for v in negative}
        if not self.positive:
            raise GenomeLMError(f"{vcf_path}: label {label}: no positive values given")
        if self.negative is not None and self.positive & self.negative:
            both = ", ".join(sorted(self.positive & self.negative))
            raise GenomeLMError(f"{vcf_path}: label {label}: {both} both positive and negative")

    def __call__(self, variant: Variant) -> int | str:
        value = variant.info.get(self.label)
        if isinstance(value, tuple):
            value = None if all(v is None for v in value) else ",".join("." if v is None else str(v) for v in value)
        if value is None:
            return "no label"
        text = str(value)
        if text.lower() in self.positive:
            return 1
        if self.negative is None or text.lower() in self.negative:
            return 0
        return f"{self.label}={text} is neither positive nor negative"
