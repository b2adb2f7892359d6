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
