"""Our .bin/.idx writer against megatron-core's own builder and reader."""

import numpy as np
import pytest
import torch

from genome_lm.data.indexed import write_index
from genome_lm.engine import quiet_megatron_import

with quiet_megatron_import():
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
@pytest.mark.parametrize("n_items", [1, 2, 17])
def test_byte_identical_to_megatron_builder(tmp_path, rng, dtype, n_items):
    items = [rng.integers(0, 200, size=int(rng.integers(1, 5000))).astype(dtype) for _ in range(n_items)]
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for item in items:
        builder.add_item(torch.from_numpy(item))
        builder.end_document()
    builder.finalize(str(tmp_path / "ref.idx"))

    with open(tmp_path / "ours.bin", "wb") as out:
        for item in items:
            out.write(item.tobytes())
    write_index(tmp_path / "ours.idx", [item.size for item in items], dtype)

    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    dataset = IndexedDataset(str(tmp_path / "ours"))
    assert len(dataset) == n_items
    for i, item in enumerate(items):
        np.testing.assert_array_equal(dataset[i], item)
