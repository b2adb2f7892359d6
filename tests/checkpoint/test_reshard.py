"""Checkpoints load under any parallel layout: written by two gloo ranks split by tensor, pipeline
or expert parallel, read by one process and by two ranks split another way, every weight and
Adam moment equal bit for bit to a one-process reference, and the logits of the batch equal the
writer's. The reference step is elementwise (reshard_worker.fake_grad), so the one-process run
and the split runs reach the same numbers without reductions."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genome_lm.checkpoint import read_weights, verify
from tests.model.hf_oracle import SPLIT_TEXT, make_checkpoint
from tests.workers import run_workers

pytestmark = pytest.mark.slow  # two gloo processes per run

WORKER = Path(__file__).with_name("reshard_worker.py")
TEXT = SPLIT_TEXT


def _run(world: int, spec: dict) -> dict:
    run_workers(WORKER, world, spec)
    return torch.load(spec["out"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    hf = make_checkpoint(root / "hf", text=TEXT, seed=5)
    ids = torch.randint(4, 9, (2, 97), generator=torch.Generator().manual_seed(2))
    torch.save(ids, root / "ids.pt")
    expected = {w: str(root / f"expected-{w}") for w in ("weights", "exp_avg", "exp_avg_sq")}
    out = _run(1, {"mode": "reference", "sizes": {}, "hf": str(hf), "ids": str(root / "ids.pt"),
                   "out": str(root / "reference.pt"), "expected": expected})
    return root, hf, expected, out["logits"]


def _save(root, hf, sizes, name):
    run = root / name
    out = _run(2, {"mode": "save", "sizes": sizes, "hf": str(hf), "ids": str(root / "ids.pt"),
                   "out": str(root / f"{name}.pt"), "run": str(run)})
    return run / "checkpoints" / "step-000001", out["logits"]


def _load(root, hf, expected, folder, world, sizes, name):
    return _run(world, {"mode": "load", "sizes": sizes, "hf": str(hf), "ids": str(root / "ids.pt"),
                        "out": str(root / f"{name}.pt"), "checkpoint": str(folder), "expected": expected})["logits"]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("writer,reader", [
    ({"tp": 2}, {"pp": 2}),
    ({"pp": 2}, {"tp": 2}),
    ({"ep": 2}, {"tp": 2, "sequence_parallel": True}),
], ids=["tp2-to-pp2", "pp2-to-tp2", "ep2-to-tp2sp"])
def test_a_checkpoint_loads_under_one_rank_and_another_split(reference, writer, reader):
    root, hf, expected, want = reference
    name = "-".join(f"{k}{v}" for k, v in writer.items())
    folder, written = _save(root, hf, writer, name)
    meta = verify(folder)
    assert meta["format"] == 2 and meta["world_size"] == 2 and meta["optimizer"] == "pieces"
    if written is not None:  # the writer's own logits (pipeline stages return none here)
        _close(written, want)
    _close(_load(root, hf, expected, folder, 1, {}, f"{name}-one"), want)
    got = _load(root, hf, expected, folder, 2, reader, f"{name}-other")
    if got is not None:
        _close(got, want)


def test_the_pieces_tile_each_tensor_once_and_read_back_whole(reference):
    """TP 2 writes a split tensor as two pieces (one per rank) and a replicated one once; the
    flat state dict equals the reference weights."""
    from genome_lm.checkpoint.huggingface import HFCheckpoint, hf_keys, is_glu

    root, hf, expected, _ = reference
    folder, _ = _save(root, hf, {"tp": 2}, "tiles")
    index = verify(folder)["tensors"]
    q = index["model/layers.0.self_attention.q_proj.weight"]
    assert sorted(p["offset"] for p in q["pieces"]) == [[0, 0], [q["shape"][0] // 2, 0]]
    assert len(index["model/layers.0.input_layernorm.weight"]["pieces"]) == 1
    fc1 = index["model/layers.0.mlp.linear_fc1.weight"]
    assert fc1["shape"][0] == 2 and sorted(p["offset"][1] for p in fc1["pieces"]) == [0, fc1["shape"][1] // 2]
    weights = read_weights(folder)
    ref = HFCheckpoint(expected["weights"])
    cfg = ref.config()
    for name, tensor in weights.items():
        keys = hf_keys(name, cfg, ref.prefix)
        parts = [ref.get(k) for k in keys]
        whole = torch.stack([t.squeeze(1) for t in parts]) if name.endswith("conv_weight") else torch.cat(parts)
        assert torch.equal(tensor, whole), (name, is_glu(name))


def test_one_process_export_of_a_split_checkpoint_matches_transformers(reference, tmp_path):
    """`genome-lm export` of a checkpoint written by EP 2 ranks, in one process with no model:
    the folder holds the reference weights, and `genome-lm parity` holds within 1e-4."""
    import os
    import re

    from genome_lm.checkpoint.huggingface import HFCheckpoint
    from genome_lm.train.export import export_run

    root, hf, expected, _ = reference
    folder, _ = _save(root, hf, {"ep": 2}, "export-ep2")
    out = export_run(folder, tmp_path / "hf", max_shard_bytes=64 * 1024)
    assert not (tmp_path / "hf.partial").exists()
    got, want = HFCheckpoint(out), HFCheckpoint(expected["weights"])
    assert sorted(got.weight_map) == sorted(want.weight_map) and len(set(got.weight_map.values())) > 1
    for key in want.weight_map:
        assert torch.equal(got.get(key), want.get(key)), key
    env = {**{k: v for k, v in os.environ.items() if k != "COLUMNS"}, "COLUMNS": "150"}
    result = subprocess.run([sys.executable, "-m", "genome_lm", "parity", "--hf", str(out), "--lengths", "1,65,300",
                             "--tol", "1e-4"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert len(re.findall(r"T=[\d,]+: max \|d logit\|", result.stdout)) == 3
