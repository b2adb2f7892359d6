"""`torchrun --nproc-per-node 2 -m genome_lm finetune`: two data-parallel ranks started by torchrun
end with the weights of one process that takes the whole global batch."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from genome_lm.checkpoint import latest_checkpoint, read_weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finetune(launcher: list[str], out, dataset) -> subprocess.CompletedProcess:
    sets = [f"data.dataset={dataset}", "train.steps=2", "data.seq_len=256", "train.global_batch_size=2",
            "model.kernel_backend=torch", "train.indexer_dense_steps=1", "train.lr=1e-2", f"train.out_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, "-m", "genome_lm", "finetune", "--config", "demo-cpu", "--quiet",
           *(a for s in sets for a in ("--set", s))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process(small_dataset, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    runs = {"one": _finetune([sys.executable], tmp_path / "one", small_dataset),
            "two": _finetune(torchrun, tmp_path / "two", small_dataset)}
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}: {run.stderr[-3000:]}"
    assert runs["two"].stdout.count("fine-tuning in") == 1  # rank 0 reports, once
    one = read_weights(latest_checkpoint(tmp_path / "one"))
    two = read_weights(latest_checkpoint(tmp_path / "two"))  # data parallel: replicas, written once
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6, msg=key)
