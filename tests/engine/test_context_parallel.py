"""The zigzag layout of context parallelism: split, merge, padding (single process; the
two-process model and trainer checks are in tests/model/test_parallel.py and tests/train)."""

import pytest
import torch

from genome_lm.engine.context_parallel import pad_for_cp, zigzag_merge, zigzag_split


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_split_takes_chunks_r_and_mirror(cp):
    length = 2 * cp * 5
    x = torch.randn(2, length, dtype=torch.float64) * torch.arange(1, length + 1)
    parts = [zigzag_split(x, cp, r) for r in range(cp)]
    chunk = length // (2 * cp)
    for r, part in enumerate(parts):
        want = list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
        assert torch.equal(part, x[:, want])
    assert torch.equal(zigzag_merge(parts), x)
    y = torch.randn(length, 3, 2)  # another dim
    assert torch.equal(zigzag_merge([zigzag_split(y, cp, r, dim=0) for r in range(cp)], dim=0), y)


@pytest.mark.parametrize("length,cp", [(1, 2), (5, 2), (1021, 2), (1022, 4), (7, 3), (12, 3)])
def test_padding_makes_any_length_splittable(length, cp):
    x = torch.arange(1, length + 1)[None]
    padded = pad_for_cp(x, cp, -1)
    assert padded.shape[1] % (2 * cp) == 0 and padded.shape[1] - length < 2 * cp
    assert torch.equal(padded[:, :length], x) and bool((padded[:, length:] == -1).all())
    assert torch.equal(zigzag_merge([zigzag_split(padded, cp, r) for r in range(cp)]), padded)
    assert pad_for_cp(x, 1, -1) is x


def test_bad_layouts_are_errors():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 \* context parallel = 4"):
        zigzag_split(torch.zeros(1, 10), 2, 0)
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        zigzag_split(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="one even length"):
        zigzag_merge([torch.zeros(1, 4), torch.zeros(1, 8)])
