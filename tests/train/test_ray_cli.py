"""`genome-lm finetune --ray-address local --workers 2` from the command line: a real local Ray
cluster, two CPU workers joined with gloo; the command exits 0, the checkpoint is written, rank 0's
summary is printed once and rank 0 alone logs to MLflow. (Markers as in test_ray.py: none.)"""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

STEPS = 2


@pytest.mark.slow
def test_finetune_on_two_local_ray_workers(small_dataset, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    overrides = [f"data.dataset={small_dataset}", f"train.out_dir={out}", f"train.steps={STEPS}", "data.seq_len=128",
                 "train.global_batch_size=2", "train.warmup_steps=1", "train.indexer_dense_steps=1",
                 "train.save_every=0", "model.kernel_backend=torch"]
    args = ["finetune", "--config", "demo-cpu", "--ray-address", "local", "--workers", "2", "--cpus-per-worker", "1",
            "--quiet"]
    for item in overrides:
        args += ["--set", item]
    env = {**os.environ, "COLUMNS": "200", "MLFLOW_DISABLE_TELEMETRY": "true", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "genome_lm", *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    checkpoint = out / "checkpoints" / f"step-{STEPS:06d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    meta = (checkpoint / "meta.json").read_text()
    assert '"world_size": 2' in meta
    # memory.host_heap: auto, resolved by the command from the plan (the demo's step fits twice over)
    assert json.loads(meta)["config"]["memory"]["host_heap"] == "keep"
    # data parallel: rank 0 writes the weights (the replicas once), each rank its own state
    written = {p.name for p in checkpoint.iterdir()}
    assert {"model-r00000.safetensors", "state-r00000.json", "state-r00001.json"} <= written

    # rank 0's summary, printed once by the driver
    output = proc.stdout + proc.stderr  # the workers' output comes through the driver
    assert output.count("fine-tuning in") == 1, proc.stdout  # the table's title (rich may wrap the path)
    assert len(re.findall(r"^checkpoint: ", proc.stdout, flags=re.M)) == 1, proc.stdout
    assert f"checkpoint: {checkpoint}" in proc.stdout
    assert proc.stdout.count("MLflow: ") == 1
    assert re.search(rf"│\s+{STEPS}\s+│", proc.stdout), proc.stdout  # the steps column of the table

    # one MLflow run (rank 0 logs; rank 1 is quiet: no tracker of its own, no tracking notes), with every step
    assert "tracking:" not in output, output[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["checkpoint"] == str(checkpoint)
    history = client.get_metric_history(run.info.run_id, "lm_loss")
    assert sorted(h.step for h in history) == list(range(1, STEPS + 1))
    assert not list(tmp_path.glob("mlruns"))  # nothing in the working folder
