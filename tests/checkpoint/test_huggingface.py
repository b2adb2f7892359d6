"""Loading and exporting glm5_next checkpoints (one process; tensor-parallel layouts are in
test_parallel.py)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from genome_lm.checkpoint.huggingface import CheckpointError, HFCheckpoint, export_hf_checkpoint, load_hf_checkpoint
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model.model import build_model
from tests.model.hf_oracle import make_checkpoint


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", seed=3)


@pytest.fixture
def model_from(hf_dir):
    def build(path=hf_dir):
        cfg = HFCheckpoint(path).config()
        return build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")

    with parallel_context() as pg:
        yield build


def _text_tensors(path):
    ckpt = HFCheckpoint(path)
    return {k: ckpt.get(k) for k in ckpt.weight_map if "visual" not in k}


@pytest.mark.slow
def test_round_trip_is_bit_identical(hf_dir, model_from, tmp_path):
    model = model_from()
    load_hf_checkpoint(model, hf_dir)
    export_hf_checkpoint(model, tmp_path / "out", like=hf_dir, max_shard_bytes=20_000)
    source, exported = _text_tensors(hf_dir), _text_tensors(tmp_path / "out")
    assert source.keys() == exported.keys()
    for key, tensor in source.items():
        assert exported[key].dtype == tensor.dtype, key
        assert torch.equal(exported[key], tensor), key
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1  # sharded with an index


def test_every_parameter_is_loaded(hf_dir, model_from):
    """Poison the model with NaN first: any parameter the loader skips stays NaN."""
    model = model_from()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.fill_(float("nan"))
    load_hf_checkpoint(model, hf_dir)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert all(torch.isfinite(b).all() for n, b in model.named_buffers() if n.endswith("expert_bias"))


def test_export_without_source_reloads_identically(hf_dir, model_from, tmp_path):
    model = model_from()
    load_hf_checkpoint(model, hf_dir)
    export_hf_checkpoint(model, tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["text_config"]["hidden_size"] == 32
    again = model_from(tmp_path / "plain")
    load_hf_checkpoint(again, tmp_path / "plain")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        if a is not None:
            assert torch.equal(a, b), name


def test_exported_weights_are_readable_like_the_rest_of_the_folder(hf_dir, model_from, tmp_path):
    """safetensors writes 0600; the export gives its weights the umask's mode, as config.json has."""
    model = model_from()
    load_hf_checkpoint(model, hf_dir)
    old = os.umask(0o022)
    try:
        export_hf_checkpoint(model, tmp_path / "plain", max_shard_bytes=20_000)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "plain").iterdir()}
    assert len([n for n in modes if n.endswith(".safetensors")]) > 1
    assert set(modes.values()) == {0o644}, modes


def _copy(hf_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(hf_dir, dst)
    return dst


def test_missing_tensor_is_named(hf_dir, model_from, tmp_path):
    dst = _copy(hf_dir, tmp_path)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    key = "model.language_model.layers.1.self_attn.k_conv1d.weight"
    del index["weight_map"][key]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="k_conv1d"):
        load_hf_checkpoint(model_from(), dst)


def test_wrong_shape_is_named(hf_dir, model_from, tmp_path):
    dst = _copy(hf_dir, tmp_path)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    key = "model.language_model.layers.0.self_attn.o_proj.weight"
    file = dst / index["weight_map"][key]
    tensors = load_file(file)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="o_proj"):
        load_hf_checkpoint(model_from(), dst)


def test_config_mismatch_and_missing_folder(hf_dir, model_from, tmp_path):
    dst = _copy(hf_dir, tmp_path)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["index_topk"] = 32
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="index_topk"):
        load_hf_checkpoint(model_from(), dst)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HFCheckpoint(tmp_path / "nowhere")


LOAD_MEMORY = """
import json, os, sys
os.environ["TORCHDYNAMO_DISABLE"] = "1"
import torch
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.checkpoint.huggingface import HFCheckpoint, load_hf_checkpoint
from genome_lm.model.model import build_model

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
with parallel_context() as pg:
    model = build_model(HFCheckpoint(path).config(), pg, ParallelSizes(), kernel_backend="torch")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark to the current RSS
    base = status("VmRSS")
    load_hf_checkpoint(model, path)
    print(json.dumps({"extra": status("VmHWM") - base}))
"""


@pytest.mark.slow
def test_loading_streams_instead_of_holding_a_second_copy(tmp_path):
    """Peak extra memory while loading stays well under the checkpoint's size (a loader that read
    every tensor first, or kept every file mapped, would need at least 1x)."""
    import subprocess
    import sys

    from genome_lm.model import get_preset

    cfg = get_preset("tiny").replace(hidden_size=256, intermediate_size=1024, n_routed_experts=32,
                                     moe_intermediate_size=256, linear_num_heads=8, linear_head_dim=32)
    with parallel_context() as pg:
        model = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")
        export_hf_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=8 * 2**20)
    size = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.safetensors"))
    assert size > 80 * 2**20
    result = subprocess.run([sys.executable, "-c", LOAD_MEMORY, str(tmp_path / "ckpt")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    extra = json.loads(result.stdout.strip().splitlines()[-1])["extra"]
    assert extra < 0.35 * size, f"loading took {extra / 2**20:.0f} MiB extra for a {size / 2**20:.0f} MiB checkpoint"
