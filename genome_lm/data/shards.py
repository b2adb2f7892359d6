"""One unit of `prepare` work: tokenize a run of windows of one chromosome.

A task is small and picklable, reads the genome through htslib and imports neither torch nor
megatron-core, so it runs the same in this process, a local worker process or a Ray task. It
returns the tokens and bit-packed soft-mask of the windows it keeps; the caller writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genome_lm.data.fasta import FastaHandle, fetch_bytes
from genome_lm.data.tokenizer import InvalidBaseError, N, count_ambiguous, describe_byte, softmask, tokenize
from genome_lm.data.windows import too_many_n
from genome_lm.errors import GenomeLMError


@dataclass(frozen=True)
class Task:
    index: int
    split: str
    chrom: str  # the record name in the FASTA
    windows: tuple[tuple[int, int], ...]  # half-open, 0-based

    @property
    def bases(self) -> int:
        return sum(end - start for start, end in self.windows)


@dataclass
class TaskResult:
    index: int
    kept: list[dict]  # per kept window: chrom, start, end and its N / soft-mask / ambiguity fractions
    skipped: list[dict]  # the same, plus the reason
    tokens: list[np.ndarray]  # per kept window, its token ids
    softmask: list[np.ndarray]  # per kept window, its soft-mask bits packed little-endian (ceil(length / 8) bytes)


def pack_softmask(soft: np.ndarray) -> np.ndarray:
    """``soft [L]`` bool packed 8 per byte, little-endian: ``[ceil(L / 8)]`` uint8."""
    return np.packbits(soft, bitorder="little")


def unpack_softmask(packed: np.ndarray, length: int, first: int = 0) -> np.ndarray:
    """Inverse of :func:`pack_softmask`: ``[length]`` bool, from bit ``first`` of ``packed``
    (a slice of a window's packed bytes starts at a multiple of 8 bases)."""
    return np.unpackbits(packed, count=first + length, bitorder="little")[first:].astype(bool)


def _fraction(count: int, length: int) -> float:
    return round(count / length, 6)


def run_task(task: Task, handle: FastaHandle, max_n_fraction: float) -> TaskResult:
    """Tokenize ``task``'s windows, skipping those with more than ``max_n_fraction`` N."""
    fasta = handle.open()
    result = TaskResult(task.index, [], [], [], [])
    for start, end in task.windows:
        raw = fetch_bytes(fasta, handle, task.chrom, start, end)
        try:
            tokens = tokenize(raw)
        except InvalidBaseError as exc:
            raise GenomeLMError(
                f"{handle.display}: record {task.chrom!r} position {start + exc.offset + 1}: "
                f"invalid character {describe_byte(exc.byte)}"
            ) from None
        length = end - start
        soft = softmask(raw)
        info = {
            "chrom": task.chrom,
            "start": start,
            "end": end,
            "n_frac": _fraction(np.count_nonzero(tokens == N), length),
            "softmask_frac": _fraction(np.count_nonzero(soft), length),
            "ambiguous_frac": _fraction(count_ambiguous(raw, tokens), length),
        }
        if too_many_n(info["n_frac"], max_n_fraction):
            result.skipped.append({**info, "reason": f"N fraction {info['n_frac']} > {max_n_fraction}"})
            continue
        result.kept.append(info)
        result.tokens.append(tokens)
        result.softmask.append(pack_softmask(soft))
    return result
