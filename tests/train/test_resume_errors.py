"""Resuming from a latest checkpoint whose weights were truncated or altered: a clear error naming
the file (from `train` and from `genome-lm finetune --resume`), the previous checkpoint still
verifies, and nothing in the run folder is written or changed."""

import os
import shutil
import subprocess
import sys

import pytest

from genome_lm.config import load_config
from genome_lm.errors import GenomeLMError
from genome_lm.train.checkpoint import CheckpointCorrupt, verify
from genome_lm.train.trainer import train

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

WEIGHTS = "model-r00000.safetensors"


def _overrides(dataset, out):
    return [f"data.dataset={dataset}", f"train.out_dir={out}", "train.steps=6", "data.seq_len=128",
            "train.global_batch_size=2", "train.warmup_steps=1", "train.indexer_dense_steps=1", "train.save_every=2",
            "model.kernel_backend=torch"]


@pytest.fixture(scope="module")
def two_checkpoints(small_dataset, tmp_path_factory):
    """A run stopped after 4 of 6 steps with checkpoints at steps 2 and 4 (latest)."""
    out = tmp_path_factory.mktemp("resume-src") / "run"
    result = train(load_config("demo-cpu", _overrides(small_dataset, out)), progress=False, max_steps=4)
    assert result.steps_done == 4
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000004"]
    assert (root / "latest").read_text().strip() == "step-000004"
    return out


def _damage(folder, how):
    path = folder / WEIGHTS
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) - 100]))
    else:  # one byte altered inside the tensor data, the size unchanged
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    return path


def _snapshot(root):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.is_dir())
            for p in sorted(root.rglob("*"))}


@pytest.fixture(params=["truncated", "altered"])
def damaged_run(request, two_checkpoints, small_dataset, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    bad = _damage(out / "checkpoints" / "step-000004", request.param)
    return out, bad, request.param


def test_resume_from_a_damaged_checkpoint_is_a_clear_error(damaged_run, small_dataset):
    out, bad, how = damaged_run
    before = _snapshot(out)
    damaged_bytes = bad.read_bytes()
    with pytest.raises(CheckpointCorrupt) as err:
        train(load_config("demo-cpu", _overrides(small_dataset, out)), progress=False, resume=True)
    assert isinstance(err.value, GenomeLMError)
    message = str(err.value)
    assert str(bad) in message and "\n" not in message
    assert ("truncated" in message) if how == "truncated" else ("checksum mismatch" in message)
    # the previous checkpoint is intact, and nothing was written: no new step, no .partial, latest unchanged
    assert verify(out / "checkpoints" / "step-000002")["step"] == 2
    assert _snapshot(out) == before
    assert bad.read_bytes() == damaged_bytes
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"


def test_finetune_resume_from_a_damaged_checkpoint_fails_with_one_line(damaged_run, small_dataset):
    out, bad, how = damaged_run
    before = _snapshot(out)
    args = ["finetune", "--config", "demo-cpu", "--resume", "--quiet"]
    for item in _overrides(small_dataset, out):
        args += ["--set", item]
    env = {**os.environ, "COLUMNS": "80", "MLFLOW_DISABLE_TELEMETRY": "true", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "genome_lm", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert str(bad) in errors[0]
    assert ("truncated" in errors[0]) if how == "truncated" else ("checksum mismatch" in errors[0])
    assert "Traceback" not in proc.stderr
    assert verify(out / "checkpoints" / "step-000002")["step"] == 2
    assert _snapshot(out) == before
