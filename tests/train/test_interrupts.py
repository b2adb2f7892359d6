"""Ctrl-C and SIGTERM: the conventional exit status (128 + the signal), and advice that names a
command that exists (``finetune`` continues with --resume; ``demo`` by running it again)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from genome_lm import cli
from genome_lm.cli import app
from genome_lm.errors import signal_exit_code
from genome_lm.train import trainer

runner = CliRunner()


def test_signal_exit_codes():
    assert signal_exit_code("SIGINT") == 130 and signal_exit_code("SIGTERM") == 143
    assert signal_exit_code("non-finite loss") is None and signal_exit_code(None) is None


def _stopped(reason):
    def train(cfg, **kwargs):
        return trainer.TrainResult(out_dir=cfg.train.out_dir, steps_done=3, stopped_by=reason)

    return train


@pytest.mark.parametrize("reason,code", [("SIGINT", 130), ("SIGTERM", 143), ("non-finite loss", 0)])
def test_finetune_stopped_by_a_signal_exits_with_its_status(tmp_path, monkeypatch, reason, code):
    monkeypatch.setattr(trainer, "train", _stopped(reason))
    result = runner.invoke(app, ["finetune", "--set", f"train.out_dir={tmp_path / 'run'}"])
    assert result.exit_code == code, result.output
    assert f"stopped by {reason}; continue with --resume" in result.output


@pytest.mark.slow
def test_demo_stopped_by_ctrl_c_exits_130_and_says_how_to_continue(tmp_path, monkeypatch):
    """The demo has no --resume: running it again continues its run."""
    monkeypatch.setattr(trainer, "train", _stopped("SIGINT"))
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), "--window", "8k", "--quiet"])
    assert result.exit_code == 130, result.output
    assert "stopped by SIGINT; run the same command again to continue" in result.output
    assert "--resume" not in result.output


@pytest.mark.parametrize("argv,advice", [(["finetune", "--config", "demo-cpu"], "with --resume"),
                                         (["--quiet", "demo"], "run the same command again to continue"),
                                         (["prepare"], "run the same command again to continue")])
def test_a_second_ctrl_c_names_how_to_continue(monkeypatch, capsys, argv, advice):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "app", interrupted)
    monkeypatch.setattr(sys, "argv", ["genome-lm", *argv])
    with pytest.raises(SystemExit) as stop:
        cli.run()
    assert stop.value.code == 130
    assert advice in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_during_finetune_checkpoints_and_exits_130(small_dataset, tmp_path):
    """The real thing: ``genome-lm finetune`` in its own process, SIGINT once training runs."""
    out = tmp_path / "run"
    sets = [f"data.dataset={small_dataset}", "train.steps=200", "data.seq_len=256", "train.global_batch_size=2",
            "model.kernel_backend=torch", f"train.out_dir={out}", "train.save_every=0"]
    proc = subprocess.Popen([sys.executable, "-m", "genome_lm", "finetune", "--quiet",
                             *(x for s in sets for x in ("--set", s))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "mlflow.db").exists():
        time.sleep(0.1)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "stopped by SIGINT; continue with --resume" in stdout
    latest = (out / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((out / "checkpoints" / latest / "meta.json").read_text())
    assert 0 < meta["step"] < 200
