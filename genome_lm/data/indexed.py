"""Megatron indexed datasets (``.bin``/``.idx``), written without importing megatron-core.

The format is megatron-core's (``megatron.core.datasets.indexed_dataset``) and its
``IndexedDataset`` is the reader everything downstream uses. ``.bin`` is the items' values
back to back; ``.idx`` is a header (magic, version 1, dtype code), the item and document
counts, then int32 item lengths, int64 byte offsets and int64 document boundaries.

`prepare` writes it here rather than through ``IndexedDatasetBuilder`` because importing
megatron-core pulls in torch: about 5 s and 700 MiB in a process that otherwise needs neither
(longer than tokenizing a human chromosome), and the builder takes one tensor per item where
`prepare` appends whole runs of windows. Tests hold the output byte-identical to
``IndexedDatasetBuilder``'s and read it back with ``IndexedDataset``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from genome_lm.errors import GenomeLMError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}


def write_index(idx_path: Path, lengths: list[int], dtype=np.uint8) -> None:
    """Write the ``.idx`` for items of ``lengths`` elements, one document per item."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
        raise ValueError("item lengths must fit in int32")
    pointers = np.zeros(sizes.size, dtype=np.int64)
    np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    documents = np.arange(sizes.size + 1, dtype=np.int64)
    with open(idx_path, "wb") as out:
        out.write(INDEX_MAGIC)
        out.write(struct.pack("<Q", 1))
        out.write(struct.pack("<B", DTYPE_CODES[dtype]))
        out.write(struct.pack("<Q", sizes.size))
        out.write(struct.pack("<Q", documents.size))
        out.write(sizes.astype(np.int32).tobytes())
        out.write(pointers.tobytes())
        out.write(documents.tobytes())


class IndexedReader:
    """One Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``) of uint8 items, memory-mapped
    and checked against its index (the training loader's reader; megatron-core's ``IndexedDataset``
    reads the same files)."""

    def __init__(self, prefix: str):
        idx_path, bin_path = Path(prefix + ".idx"), Path(prefix + ".bin")
        for path in (idx_path, bin_path):
            if not path.exists():
                raise GenomeLMError(f"{path}: missing (the dataset folder is incomplete; rerun `genome-lm prepare`)")
        raw = idx_path.read_bytes()
        head = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
        if len(raw) < head or raw[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise GenomeLMError(f"{idx_path}: not a Megatron indexed-dataset index")
        version, code, n_items, n_docs = struct.unpack_from("<QBQQ", raw, len(INDEX_MAGIC))
        if version != 1 or code != DTYPE_CODES[np.dtype(np.uint8)]:
            raise GenomeLMError(f"{idx_path}: expected version 1 and uint8 items, "
                                f"got version {version}, dtype code {code}")
        if len(raw) != head + 4 * n_items + 8 * n_items + 8 * n_docs:
            raise GenomeLMError(f"{idx_path}: truncated or corrupt index")
        self.sizes = np.frombuffer(raw, np.int32, n_items, head).astype(np.int64)
        self.pointers = np.frombuffer(raw, np.int64, n_items, head + 4 * n_items)
        self.path = bin_path
        expected = int(self.pointers[-1] + self.sizes[-1]) if n_items else 0
        if bin_path.stat().st_size != expected:
            raise GenomeLMError(f"{bin_path}: {bin_path.stat().st_size} bytes, its index describes {expected}")
        self.data = np.memmap(bin_path, dtype=np.uint8, mode="r") if expected else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return self.sizes.size

    def read(self, item: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of ``item`` (a copy)."""
        size = int(self.sizes[item])
        stop = size if stop is None else min(stop, size)
        base = int(self.pointers[item])
        return np.array(self.data[base + start : base + stop])
