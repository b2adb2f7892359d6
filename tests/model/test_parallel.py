"""Tensor and expert parallel over two gloo processes give the single-process loss and gradients,
and a checkpoint loaded into a split model exports back bit for bit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genome_lm.engine.parallel import free_port
from genome_lm.model.hf_checkpoint import HFCheckpoint

from .hf_oracle import make_checkpoint

WORKER = Path(__file__).with_name("dist_worker.py")
# 4 MLA heads, 4 KDA heads, 4 experts: every split below divides them; topk 16 < T so selection matters
TEXT = {"num_attention_heads": 4, "num_key_value_heads": 4, "linear_num_heads": 4, "vocab_size": 16}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    ckpt = make_checkpoint(root / "hf", text=TEXT, seed=9)
    ids = torch.randint(4, 9, (2, 150), generator=torch.Generator().manual_seed(3))
    torch.save(ids, root / "ids.pt")
    return root, ckpt


def _run(root, ckpt, world, sizes, name, indexer_loss="off", export=None):
    spec = {"hf": str(ckpt), "sizes": sizes, "ids": str(root / "ids.pt"), "out": str(root / f"{name}.pt"),
            "indexer_loss": indexer_loss, "export": str(export) if export else None}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    return torch.load(root / f"{name}.pt")


@pytest.mark.parametrize("sizes,indexer_loss", [({"tp": 2}, "sparse"), ({"ep": 2}, "off"), ({"tp": 2, "etp": 2}, "dense")],
                         ids=["tp2-sparse-indexer-loss", "ep2", "tp2-etp2-dense-indexer-loss"])
def test_split_model_matches_one_process(setup, sizes, indexer_loss):
    root, ckpt = setup
    name = "-".join(f"{k}{v}" for k, v in sizes.items())
    one = _run(root, ckpt, 1, {}, f"one-{indexer_loss}", indexer_loss)
    two = _run(root, ckpt, 2, sizes, name, indexer_loss)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert one["grads"].keys() == two["grads"].keys()
    for key, g in one["grads"].items():
        err = (g - two["grads"][key]).abs().max() / g.abs().max().clamp_min(1e-8)
        assert err < 1e-4, (key, float(err))


@pytest.mark.parametrize("sizes", [{"tp": 2}, {"ep": 2}], ids=["tp2", "ep2"])
def test_checkpoint_round_trip_through_a_split_model(setup, sizes):
    root, ckpt = setup
    out = root / ("export-" + "-".join(sizes))
    _run(root, ckpt, 2, sizes, "export", export=out)
    src, dst = HFCheckpoint(ckpt), HFCheckpoint(out)
    keys = [k for k in src.weight_map if "visual" not in k]
    assert sorted(keys) == sorted(dst.weight_map)
    for key in keys:
        assert torch.equal(src.get(key), dst.get(key)), key
