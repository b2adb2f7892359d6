"""Regions of a chromosome, written as samtools writes them: ``chr2``, ``chr2:1,800,001``
(to the end), ``chr2:1-1,800,000`` (1-based, both ends included, commas allowed).

A region lets a user hold out part of a chromosome: train on ``chr2:1-1,800,000`` and evaluate
on ``chr2:1,800,001-2,333,275``. Internally a region is 0-based and half-open, as windows are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from genome_lm.errors import GenomeLMError

_COORD = r"\d{1,3}(?:,\d{3})+|\d+"
_REGION = re.compile(rf"^(?P<name>.+?):(?P<start>{_COORD})(?:-(?P<end>{_COORD}))?$")
_THOUSANDS = re.compile(r"^\d{3}(?:\D|$)")


@dataclass(frozen=True)
class Region:
    """``name`` (as the user wrote it), ``start``/``end`` 0-based half-open; ``end`` None = to the
    chromosome's end, ``start`` 0 and ``end`` None = the whole chromosome."""

    name: str
    start: int = 0
    end: int | None = None

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end is None

    def bounded(self, length: int, source: str) -> "Region":
        """This region with its end set, checked against a record of ``length`` bases."""
        end = length if self.end is None else self.end
        if end > length or self.start >= length:
            raise GenomeLMError(f"{source}: region {self} reaches past the end of {self.name} ({length:,} bases)")
        return Region(self.name, self.start, end)

    def overlaps(self, other: "Region") -> bool:
        """Both bounded (``bounded``) and on the same record."""
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:
        if self.whole:
            return self.name
        end = f"-{self.end:,}" if self.end is not None else ""
        return f"{self.name}:{self.start + 1:,}{end}"


def parse_region(text: str, present: list[str] | tuple[str, ...] = ()) -> Region:
    """``chr2``, ``chr2:START`` or ``chr2:START-END`` (1-based, inclusive) -> Region. A record name
    in ``present`` is taken whole even when it looks like a region (hg38's ``HLA-A*01:01:01:01``),
    as samtools does."""
    text = text.strip()
    if not text:
        raise GenomeLMError("an empty chromosome or region")
    if text in present:
        return Region(text)
    m = _REGION.match(text)
    if m is None:
        if re.search(r":[\d,-]+$", text):
            raise GenomeLMError(f"region {text!r}: coordinates must read START or START-END, 1-based, "
                                "commas allowed (chr2:1-1,800,000)")
        return Region(text)
    start = int(m["start"].replace(",", ""))
    end = None if m["end"] is None else int(m["end"].replace(",", ""))
    if start < 1:
        raise GenomeLMError(f"region {text!r}: positions are 1-based; the first base is 1")
    if end is not None and end < start:
        raise GenomeLMError(f"region {text!r}: ends ({end:,}) before it starts ({start:,})")
    return Region(m["name"], start - 1, end)


def split_regions(text: str) -> tuple[str, ...]:
    """A comma-separated list of chromosomes or regions, where a region's coordinates may hold
    thousands separators: ``"chr1,chr2:1-1,800,000"`` -> ``("chr1", "chr2:1-1,800,000")``. A
    piece of exactly three digits after a region's coordinates continues them."""
    parts: list[str] = []
    for piece in text.split(","):
        piece = piece.strip()
        if parts and ":" in parts[-1] and _THOUSANDS.match(piece) and parts[-1][-1].isdigit():
            parts[-1] += "," + piece
        elif piece:
            parts.append(piece)
    return tuple(parts)
