"""Training under nohup, CI or a log file: progress in plain lines (``genome_lm.progress``)."""

import pytest


@pytest.mark.slow
def test_a_piped_finetune_reports_progress_in_its_log(small_dataset, tmp_path):
    """`genome-lm finetune ... 2> log`: plain lines with step, loss and tokens/s."""
    import os
    import subprocess
    import sys

    args = ["finetune", "--config", "demo-cpu"]
    for item in (f"data.dataset={small_dataset}", f"train.out_dir={tmp_path / 'run'}", "train.steps=3",
                 "data.seq_len=128", "train.global_batch_size=2", "train.indexer_dense_steps=1",
                 "model.kernel_backend=torch"):
        args += ["--set", item]
    env = {**os.environ, "GENOME_LM_PROGRESS_SECONDS": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
           "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "genome_lm", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train: step")]
    assert [line.split(",")[0] for line in lines] == ["train: step 1/3", "train: step 2/3", "train: step 3/3"]
    assert all(", loss " in line and ", tok/s " in line for line in lines)
