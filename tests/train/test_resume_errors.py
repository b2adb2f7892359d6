"""Resuming from a latest checkpoint whose weights were truncated or altered: a clear error naming
the file (from `train` and from `genome-lm finetune --resume`), the previous checkpoint still
verifies, and nothing in the run folder is written or changed."""

import os
import shutil
import subprocess
import sys

import pytest

from genome_lm.checkpoint import CheckpointCorrupt, verify
from genome_lm.config import load_config
from genome_lm.errors import GenomeLMError
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


@pytest.mark.slow
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


def test_a_damaged_latest_names_the_newest_intact_checkpoint(damaged_run, small_dataset):
    """The error says which checkpoint still verifies and how to resume from it; doing so works."""
    out, bad, _ = damaged_run
    with pytest.raises(CheckpointCorrupt) as err:
        train(load_config("demo-cpu", _overrides(small_dataset, out)), progress=False, resume=True)
    intact = out / "checkpoints" / "step-000002"
    assert f"the newest intact checkpoint is {intact}" in str(err.value)
    assert f"--resume-from {intact}" in str(err.value)
    result = train(load_config("demo-cpu", _overrides(small_dataset, out)), progress=False, resume_from=intact)
    assert result.resumed_from == intact and result.steps_done == 6
    assert [m.step for m in result.history] == [3, 4, 5, 6] and [m.step for m in result.earlier] == [1, 2]
    assert verify(out / "checkpoints" / "step-000004")["step"] == 4  # the damaged one was written again


def test_resume_from_by_name_and_a_bad_name(two_checkpoints, small_dataset, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    cfg = load_config("demo-cpu", _overrides(small_dataset, out))
    with pytest.raises(GenomeLMError, match="step-000009: not a checkpoint folder"):
        train(cfg, progress=False, resume_from="step-000009")
    result = train(cfg, progress=False, resume_from="step-000002", max_steps=1)
    assert result.resumed_from == out / "checkpoints" / "step-000002" and result.steps_done == 3


@pytest.mark.slow
def test_a_new_run_into_a_run_folder_is_refused(two_checkpoints, small_dataset, tmp_path):
    """Without --resume the checkpoints of the run there are never overwritten silently; --overwrite
    replaces them, and says so."""
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    before = _snapshot(out)
    cfg = load_config("demo-cpu", _overrides(small_dataset, out))
    with pytest.raises(GenomeLMError) as err:
        train(cfg, progress=False)
    message = str(err.value)
    assert str(out) in message and "step-000004" in message and "\n" not in message
    assert "--resume" in message and "train.out_dir" in message and "--overwrite" in message
    assert _snapshot(out) == before
    args = ["finetune", "--config", "demo-cpu", "--quiet"]
    for item in _overrides(small_dataset, out):
        args += ["--set", item]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "genome_lm", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 1 and [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "already holds a training run" in proc.stderr and _snapshot(out) == before
    proc = subprocess.run([sys.executable, "-m", "genome_lm", *args, "--overwrite", "--set", "train.steps=2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deleting its checkpoints" in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002"]


@pytest.mark.slow
def test_resumed_run_repeats_no_step_and_reports_the_whole_run(two_checkpoints, small_dataset, tmp_path):
    """A run killed after step 4 whose last checkpoint is step 2 (latest rewound to it): MLflow had
    steps 1-4; resumed, the run's history holds each of steps 1-6 once, the summary starts at
    step 1 and says where it resumed from."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    (out / "checkpoints" / "latest").write_text("step-000002\n")
    args = ["finetune", "--config", "demo-cpu", "--quiet", "--resume"]
    for item in _overrides(small_dataset, out):
        args += ["--set", item]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TORCHDYNAMO_DISABLE": "1", "COLUMNS": "150"}
    proc = subprocess.run([sys.executable, "-m", "genome_lm", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step 2 ({out / 'checkpoints' / 'step-000002'})" in " ".join(proc.stdout.split())
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1  # the run holding the stale steps 3-4 was continued and deleted
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "lm_loss"))
    assert steps == [1, 2, 3, 4, 5, 6]
    first_loss = min(client.get_metric_history(runs[0].info.run_id, "lm_loss"), key=lambda m: m.step).value
    assert f"{first_loss:.4f} (1)" in proc.stdout  # the run's first loss, not the first after resuming
