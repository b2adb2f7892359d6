"""One unit of `prepare` work: tokenize a run of windows of one chromosome into part files.

A task is small and picklable, reads the genome through htslib and imports neither torch nor
megatron-core, so it runs the same in a local worker process or a Ray task. Its part files are
written under temporary names and renamed into place, the ``.json`` last: a task whose
``.json`` exists is complete, which is what lets an interrupted run resume.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from genome_lm.data.fasta import FastaHandle, fetch_bytes
from genome_lm.data.tokenizer import FLAG_AMBIGUOUS, FLAG_SOFTMASK, N, InvalidBaseError, describe_byte, tokenize
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


def part_paths(parts_dir: Path, index: int) -> tuple[Path, Path, Path]:
    stem = parts_dir / f"{index:06d}"
    return stem.with_suffix(".tokens"), stem.with_suffix(".flags"), stem.with_suffix(".json")


def _fraction(count: int, length: int) -> float:
    return round(count / length, 6)


def run_task(task: Task, handle: FastaHandle, max_n_frac: float, parts_dir: str) -> dict:
    """Tokenize ``task``'s windows; returns (and stores) what was kept and what was skipped."""
    tokens_path, flags_path, json_path = part_paths(Path(parts_dir), task.index)
    if json_path.exists():  # finished by an earlier, interrupted run
        return json.loads(json_path.read_text())
    fasta = handle.open()
    kept, skipped = [], []
    suffix = f".tmp{os.getpid()}"
    tmp_tokens, tmp_flags = Path(str(tokens_path) + suffix), Path(str(flags_path) + suffix)
    try:
        with open(tmp_tokens, "wb") as tok_out, open(tmp_flags, "wb") as flag_out:
            for start, end in task.windows:
                raw = fetch_bytes(fasta, handle, task.chrom, start, end)
                try:
                    tokens, flags = tokenize(raw)
                except InvalidBaseError as exc:
                    raise GenomeLMError(
                        f"{handle.display}: record {task.chrom!r} position {start + exc.offset + 1}: "
                        f"invalid character {describe_byte(exc.byte)}"
                    ) from None
                length = end - start
                info = {
                    "chrom": task.chrom,
                    "start": start,
                    "end": end,
                    "n_frac": _fraction(np.count_nonzero(tokens == N), length),
                    "softmask_frac": _fraction(np.count_nonzero(flags & FLAG_SOFTMASK), length),
                    "ambiguous_frac": _fraction(np.count_nonzero(flags & FLAG_AMBIGUOUS), length),
                }
                if info["n_frac"] > max_n_frac:
                    skipped.append({**info, "reason": f"N fraction {info['n_frac']} > {max_n_frac}"})
                    continue
                tok_out.write(tokens.tobytes())
                flag_out.write(flags.tobytes())
                kept.append(info)
        os.replace(tmp_tokens, tokens_path)
        os.replace(tmp_flags, flags_path)
    finally:
        tmp_tokens.unlink(missing_ok=True)
        tmp_flags.unlink(missing_ok=True)
    result = {"index": task.index, "split": task.split, "chrom": task.chrom, "kept": kept, "skipped": skipped}
    tmp_json = Path(str(json_path) + suffix)
    tmp_json.write_text(json.dumps(result))
    os.replace(tmp_json, json_path)
    return result
