"""The piece format's own rules, in one process: bad checkpoints are one-line errors naming the
folder; a box is read from the pieces that meet it, whatever their split."""

import json

import pytest
import torch

from genome_lm.checkpoint import load_checkpoint, read_weights, save_checkpoint
from genome_lm.checkpoint.sharded import Box, PieceReader, _fingerprint
from genome_lm.errors import GenomeLMError


def _model(width=8, layers=2, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _one_line(excinfo, *words):
    text = str(excinfo.value)
    assert "\n" not in text
    for w in words:
        assert str(w) in text, text


def test_another_models_checkpoint_is_refused(tmp_path):
    folder = save_checkpoint(tmp_path, 1, _model(), None, {})
    with pytest.raises(GenomeLMError) as excinfo:
        load_checkpoint(folder, _model(width=6))
    _one_line(excinfo, folder, "0.weight", "(8, 8)", "(6, 6)")
    with pytest.raises(GenomeLMError) as excinfo:
        load_checkpoint(folder, _model(layers=3))
    _one_line(excinfo, folder, "holds no 2.", "2 missing")
    with pytest.raises(GenomeLMError) as excinfo:
        load_checkpoint(folder, _model(layers=1))
    _one_line(excinfo, folder, "the model has no 1.", "2 extra")


def test_a_missing_piece_is_named(tmp_path):
    folder = save_checkpoint(tmp_path, 1, _model(), None, {})
    meta = json.loads((folder / "meta.json").read_text())
    entry = meta["tensors"]["model/1.weight"]
    half = entry["pieces"][0]
    entry["pieces"] = [{**half, "size": [4, 8]}]  # as if the second rank's half were lost
    (folder / "meta.json").write_text(json.dumps(meta))  # meta.json carries no checksum of its own
    with pytest.raises(GenomeLMError) as excinfo:
        load_checkpoint(folder, _model())
    _one_line(excinfo, folder, "1.weight", "cover 32 of the 64", "a piece is missing")
    (folder / "model-r00000.safetensors").unlink()
    with pytest.raises(GenomeLMError, match="model-r00000.safetensors: missing"):
        read_weights(folder)


def test_boxes_are_read_across_pieces_of_any_split(tmp_path):
    """A [6, 10] tensor stored as three row pieces is read back in column boxes, row boxes and
    a box that straddles pieces, against slicing the whole tensor."""
    from safetensors.torch import save_file

    whole = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    pieces = []
    for i, (a, b) in enumerate([(0, 2), (2, 4), (4, 6)]):
        save_file({f"w@{a},0": whole[a:b].contiguous()}, str(tmp_path / f"model-r{i:05d}.safetensors"))
        pieces.append({"file": f"model-r{i:05d}.safetensors", "name": f"w@{a},0", "offset": [a, 0],
                       "size": [b - a, 10]})
    reader = PieceReader(tmp_path, {"model/w": {"shape": [6, 10], "dtype": "float32", "pieces": pieces}})
    for offset, size in [((0, 0), (6, 5)), ((0, 5), (6, 5)), ((1, 3), (4, 4)), ((3, 0), (3, 10)), ((5, 9), (1, 1))]:
        got = reader.read(Box("model/w", (6, 10), offset, size))
        want = whole[offset[0]:offset[0] + size[0], offset[1]:offset[1] + size[1]]
        assert torch.equal(got, want), (offset, size)
    assert torch.equal(reader.full("model/w"), whole)
    with pytest.raises(GenomeLMError, match="has shape \\(6, 10\\) in the checkpoint, the model's is \\(5, 10\\)"):
        reader.read(Box("model/w", (5, 10), (0, 0), (5, 10)))
    reader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_base_fingerprint_is_the_same_over_any_split_and_changes_with_any_value(dtype):
    """The base digest's per-tensor fingerprint: the boxes of any split (uneven, in any order) add
    up to the whole tensor's; one value changed by one unit in the last place, or two values
    swapped, changes it."""
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(7, 5, 3, generator=gen).to(dtype)
    whole = _fingerprint(full, Box("model/w", (7, 5, 3), (0, 0, 0), (7, 5, 3)))
    for cuts in ([(0, 3), (3, 7)], [(0, 1), (1, 6), (6, 7)]):
        for dim in (0, 1):
            parts = []
            for lo, hi in cuts:
                hi = min(hi, full.shape[dim])
                if lo >= hi:
                    continue
                offset, size = [0, 0, 0], list(full.shape)
                offset[dim], size[dim] = lo, hi - lo
                parts.append(_fingerprint(full.narrow(dim, lo, hi - lo).contiguous(),
                                          Box("model/w", (7, 5, 3), tuple(offset), tuple(size))))
            assert sum(reversed(parts)) == whole
    nudged = full.clone()
    nudged.view({2: torch.int16, 4: torch.int32}[full.element_size()])[4, 2, 1] += 1  # one unit in the last place
    whole_box = Box("model/w", (7, 5, 3), (0,) * 3, (7, 5, 3))
    assert not torch.equal(nudged, full) and _fingerprint(nudged, whole_box) != whole
    swapped = full.clone()
    swapped[0, 0, 0], swapped[6, 4, 2] = full[6, 4, 2], full[0, 0, 0]
    assert _fingerprint(swapped, Box("model/w", (7, 5, 3), (0,) * 3, (7, 5, 3))) != whole
