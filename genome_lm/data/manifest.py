"""The dataset manifest: what a prepared dataset holds and where every token came from.

Layout of a prepared dataset folder (one per ``genome-lm prepare --out``)::

    manifest.json               this file's content (schema below)
    <split>.bin / .idx          Megatron indexed dataset of token ids (uint8), one document per window
    <split>_softmask.bin / .idx one item per window: its soft-mask bits, packed 8 per byte,
                                little-endian (``genome_lm.data.shards.unpack_softmask``)

Token ``i`` of document ``d`` in split ``s`` is base ``windows[d].start + i`` (0-based) of
record ``windows[d].chrom`` in the source FASTA: :meth:`Manifest.locate` does that look-up.

Schema ``genome-lm.dataset/1`` (JSON object)::

    schema        "genome-lm.dataset/1"
    request_key   hash of the source's path/size/mtime and every option that shapes the output
    source        {path, size, mtime_ns, sha256, compression, records: [{name, length}]}
    tokenizer     {name, vocab, n_token, flag_bits}
    windows       {window, stride, tail, min_tail, max_n_frac}
    splits        {name: {prefix, chromosomes: [{requested, record, length}], n_tokens,
                   windows: [{chrom, start, end, n_frac, softmask_frac, ambiguous_frac}],
                   skipped: [... same + reason], dropped_tails: [{chrom, start, end}]}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from genome_lm.errors import GenomeLMError

SCHEMA = "genome-lm.dataset/1"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Window:
    chrom: str
    start: int
    end: int
    n_frac: float
    softmask_frac: float
    ambiguous_frac: float

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Split:
    name: str
    prefix: str
    windows: tuple[Window, ...]
    data: dict  # the split's JSON object as written

    @property
    def n_tokens(self) -> int:
        return self.data["n_tokens"]

    @property
    def softmask_fraction(self) -> float:
        """Soft-masked (lower-case) bases over all bases of the split's windows."""
        return sum(w.softmask_frac * w.length for w in self.windows) / max(self.n_tokens, 1)

    @property
    def n_fraction(self) -> float:
        """N bases over all bases of the split's windows."""
        return sum(w.n_frac * w.length for w in self.windows) / max(self.n_tokens, 1)

    @property
    def records(self) -> list[str]:
        """The FASTA records the split was cut from."""
        return [c["record"] for c in self.data["chromosomes"]]


@dataclass(frozen=True)
class Manifest:
    folder: Path
    data: dict

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        path = Path(folder) / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise GenomeLMError(f"{folder}: not a prepared dataset (no {MANIFEST}); run `genome-lm prepare`") from None
        except json.JSONDecodeError as exc:
            raise GenomeLMError(f"{path}: corrupt manifest ({exc})") from None
        if data.get("schema") != SCHEMA:
            raise GenomeLMError(f"{path}: unsupported manifest schema {data.get('schema')!r} (expected {SCHEMA})")
        return cls(Path(folder), data)

    @property
    def request_key(self) -> str:
        return self.data["request_key"]

    def split(self, name: str) -> Split:
        try:
            raw = self.data["splits"][name]
        except KeyError:
            raise GenomeLMError(f"{self.folder}: no split {name!r}; splits: {', '.join(self.data['splits'])}") from None
        windows = tuple(Window(**{k: w[k] for k in Window.__dataclass_fields__}) for w in raw["windows"])
        return Split(name, raw["prefix"], windows, raw)

    def path_prefix(self, name: str) -> str:
        """The Megatron ``path_prefix`` of a split's tokens (``IndexedDataset(prefix)``)."""
        return str(self.folder / self.split(name).prefix)

    def softmask_prefix(self, name: str) -> str:
        """The ``path_prefix`` of a split's packed soft-mask bits."""
        return self.path_prefix(name) + "_softmask"

    def locate(self, split: str, doc: int, offset: int) -> tuple[str, int]:
        """``(record name, 0-based position)`` of token ``offset`` of document ``doc``."""
        window = self.split(split).windows[doc]
        if not 0 <= offset < window.length:
            raise IndexError(f"offset {offset} outside document {doc} of length {window.length}")
        return window.chrom, window.start + offset


def write_manifest(folder: Path, data: dict) -> None:
    path = Path(folder) / MANIFEST
    tmp = path.with_name(MANIFEST + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
