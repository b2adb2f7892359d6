"""Chromosome names across conventions.

The same human chromosome is ``chr1`` (UCSC), ``1`` (Ensembl/NCBI), ``NC_000001.11`` (RefSeq,
GRCh38; ``.10`` in GRCh37) or ``CM000663.2`` (GenBank, GRCh38). :func:`canonical` reduces a
name to a convention-free key ("1", "X", "M", "I" for ``CHROMOSOME_I``...) and
:func:`resolve` finds the record a user asked for: an exact name first, then a unique
canonical match.
"""

from __future__ import annotations

import re

from genome_lm.errors import GenomeLMError

_REFSEQ_HUMAN = re.compile(r"^NC_0000(\d\d)\.\d+$")
_REFSEQ_MITO = re.compile(r"^NC_012920\.\d+$")
_GENBANK_GRCH38 = re.compile(r"^CM0006(\d\d)\.\d+$")  # CM000663 (chr1) .. CM000686 (chrY)
_PREFIX = re.compile(r"^(chromosome|chrom|chr)[_ -]?", re.IGNORECASE)
_SEX_MITO = {"23": "X", "24": "Y"}


def canonical(name: str) -> str:
    """A convention-free key for a chromosome name."""
    if m := _REFSEQ_HUMAN.match(name):
        number = str(int(m.group(1)))
        return _SEX_MITO.get(number, number)
    if _REFSEQ_MITO.match(name):
        return "M"
    if (m := _GENBANK_GRCH38.match(name)) and 63 <= int(m.group(1)) <= 86:
        number = str(int(m.group(1)) - 62)
        return _SEX_MITO.get(number, number)
    key = _PREFIX.sub("", name)
    if key.isdigit():
        return str(int(key))
    key = key.upper()
    return "M" if key == "MT" else key


def resolve(requested: str, present: list[str], source: str) -> str:
    """The record name in ``present`` that ``requested`` refers to.

    Raises :class:`GenomeLMError` naming ``source`` and listing the names present when there
    is no match, or when several records share the requested canonical key.
    """
    if requested in present:
        return requested
    key = canonical(requested)
    matches = [name for name in present if canonical(name) == key]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise GenomeLMError(f"{source}: chromosome {requested!r} is ambiguous: matches {', '.join(matches)}")
    shown = ", ".join(present[:25]) + (f", ... ({len(present) - 25} more)" if len(present) > 25 else "")
    raise GenomeLMError(f"{source}: no chromosome {requested!r}; records present: {shown}")
