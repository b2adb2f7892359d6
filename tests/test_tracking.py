"""Tracker: runs land in the store (read back with MLflow's own client), resume continues a run
(without repeated steps), a run folder can be moved, and a tracking server that is missing,
silent or killed mid-run never stops the caller and loses nothing: the run folder's own store
takes over."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from genome_lm import tracking
from genome_lm.tracking import PARAM_VALUE_LIMIT, Tracker

# MLflow's SQLite store uses a SQLAlchemy option SQLAlchemy deprecates (nothing a test can act on).
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


@pytest.fixture(autouse=True)
def _quiet_mlflow(monkeypatch):
    # No usage reports from test runs (and no network to send them to).
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "genome_lm.tracking" and r.levelno >= logging.WARNING]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for item in client.list_artifacts(run_id, path):
        out |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return out


def _figure():
    from matplotlib.figure import Figure  # no pyplot: no backend or global state

    fig = Figure(figsize=(2, 2))
    fig.add_subplot().plot([1, 2, 3])
    return fig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_store_round_trip_and_resume(tmp_path, monkeypatch, caplog):
    from mlflow.tracking import MlflowClient

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing may land in the working folder (MLflow's ./mlruns default)
    run_dir = tmp_path / "run"
    config = {"model": {"preset": "tiny", "layers": 4, "pattern": ["kda", "dsa"]},
              "data": {"path": "x" * 800}, "train": {"lr": 3e-4, "steps": 10}}
    extra = {f"sweep.k{i:03d}": i for i in range(150)}  # more than one 100-param batch
    note = tmp_path / "note.txt"
    note.write_text("hello\n")

    with Tracker(None, experiment="exp", run_name="demo", run_dir=run_dir) as tracker:
        assert tracker.active
        run_id = tracker.run_id
        tracker.log_config(config)
        tracker.log_params(extra)
        tracker.log_params({"checkpoint": "step-000002"})
        tracker.set_tags({"stage": "pretrain"})
        tracker.log_metrics({"loss": 2.0, "grad_norm": 1.0, "loss/token (bits)": 3.0}, step=1)
        tracker.log_metrics({"loss": 1.5, "grad_norm": float("nan")}, step=2)
        tracker.log_metrics({"loss": 1.25, "grad_norm": float("inf")}, step=3)
        tracker.log_artifact(note)
        tracker.log_figure(_figure(), "curve")
        location = tracker.location
    assert isinstance(run_id, str) and run_id in location
    assert f"mlflow ui --backend-store-uri sqlite:///{run_dir / 'mlflow.db'}," in location
    assert location.endswith(f"then open http://127.0.0.1:5000/#/experiments/{tracker.info()['experiment_id']}/runs/"
                             f"{run_id}")  # the run's own page: MLflow's home page is its GenAI overview
    # the only warning: one note for the two non-finite values
    assert len(_warnings(caplog)) == 1 and "non-finite" in _warnings(caplog)[0]

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    params = run.data.params
    assert params["model.layers"] == "4" and params["model.preset"] == "tiny"
    assert params["model.pattern"] == '["kda", "dsa"]' and params["train.lr"] == "0.0003"
    assert len(params["data.path"]) == PARAM_VALUE_LIMIT and params["data.path"].endswith("...")
    assert all(params[k] == str(v) for k, v in extra.items())
    assert run.data.tags["stage"] == "pretrain"
    assert _history(client, run_id, "loss") == [(1, 2.0), (2, 1.5), (3, 1.25)]
    assert _history(client, run_id, "grad_norm") == [(1, 1.0)]
    assert _history(client, run_id, "loss/token _bits_") == [(1, 3.0)]
    assert _artifacts(client, run_id) == {"config.yaml", "note.txt", "figures/curve.png"}
    local = client.download_artifacts(run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(local).read_text()) == config
    assert (run_dir / "mlartifacts").is_dir() and list(cwd.iterdir()) == []

    caplog.clear()
    with Tracker(None, experiment="exp", run_name="ignored", run_dir=run_dir, run_id=run_id) as tracker:
        assert tracker.run_id == run_id
        assert client.get_run(run_id).info.status == "RUNNING"
        tracker.log_metrics({"loss": 1.0}, step=4)
        tracker.log_metrics({"loss": 0.5}, step=5)
        tracker.log_params({"checkpoint": "step-000005", "model.layers": 4})  # changed, unchanged
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _history(client, run_id, "loss") == [(1, 2.0), (2, 1.5), (3, 1.25), (4, 1.0), (5, 0.5)]
    assert run.data.params["checkpoint"] == "step-000002"  # params are write-once in MLflow ...
    assert run.data.tags["checkpoint"] == "step-000005"  # ... so the new value is a tag
    assert _warnings(caplog) == []

    # a run id this store does not know (the tracking URI changed): a new run, tagged
    with Tracker(None, experiment="exp", run_dir=run_dir, run_id="0" * 32) as tracker:
        new_id = tracker.run_id
        tracker.log_metrics({"loss": 0.25}, step=6)
    assert new_id not in (None, run_id)
    assert client.get_run(new_id).data.tags["genome_lm.resumed_from"] == "0" * 32
    assert _history(client, new_id, "loss") == [(6, 0.25)]
    assert len(_warnings(caplog)) == 1 and "0" * 32 in _warnings(caplog)[0]

    # an exception in the block ends the run as FAILED and is not swallowed
    with pytest.raises(RuntimeError):
        with Tracker(None, experiment="exp", run_dir=run_dir, run_id=new_id):
            raise RuntimeError("boom")
    assert client.get_run(new_id).info.status == "FAILED"


def test_disabled_tracker_is_a_noop(tmp_path, caplog):
    t0 = time.perf_counter()
    with Tracker("http://127.0.0.1:9", experiment="exp", run_dir=tmp_path, enabled=False) as tracker:
        tracker.log_config({"a": {"b": 1}})
        tracker.log_params({"a": 1})
        tracker.log_metrics({"loss": 1.0}, step=1)
        tracker.log_artifact(tmp_path / "missing.txt")
        tracker.log_figure(object(), "never-saved")
        tracker.set_tags({"x": "y"})
    assert time.perf_counter() - t0 < 0.5
    assert tracker.run_id is None and tracker.location == "" and not tracker.active
    assert list(tmp_path.iterdir()) == [] and _warnings(caplog) == []


def _log_everything(tracker: Tracker, tmp_path: Path) -> None:
    note = tmp_path / "note.txt"
    note.write_text("x")
    tracker.log_config({"model": {"layers": 2}})
    tracker.log_params({"a": 1})
    for step in range(1, 4):
        tracker.log_metrics({"loss": 1.0 / step}, step=step)
    tracker.log_artifact(note)
    tracker.log_figure(_figure(), "curve")
    tracker.set_tags({"k": "v"})


def _local_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def test_unreachable_server_falls_back_to_the_run_folder(tmp_path, caplog):
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    t0 = time.perf_counter()
    with Tracker(uri, experiment="exp", run_name="r", run_dir=tmp_path) as tracker:
        _log_everything(tracker, tmp_path)
    assert time.perf_counter() - t0 < 15
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and uri in warnings[0] and "\n" not in warnings[0]
    local = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {local}" in warnings[0]  # how to look at it
    assert f"mlflow ui --backend-store-uri {local}," in tracker.location
    client = _local_client(tmp_path)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params == {"model.layers": "2", "a": "1"} and run.data.tags["k"] == "v"
    assert run.data.tags["genome_lm.fallback_from"] == uri
    assert _history(client, tracker.run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert _artifacts(client, tracker.run_id) == {"config.yaml", "note.txt", "figures/curve.png"}
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ  # the short timeouts were scoped to the calls


def test_silent_server_costs_seconds(tmp_path, caplog):
    """A server that accepts connections and never answers: the short timeout applies."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.perf_counter()
        with Tracker(uri, experiment="exp", run_dir=tmp_path, timeout_s=1) as tracker:
            _log_everything(tracker, tmp_path)
        elapsed = time.perf_counter() - t0
    assert elapsed < 15, elapsed
    assert len(_warnings(caplog)) == 1 and uri in _warnings(caplog)[0]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on a free port with a SQLite store and proxied artifacts in tmp_path.
    Yields (uri, artifacts folder, kill); the finalizer always kills the process group."""
    port = _free_port()
    store = tmp_path / "server"
    store.mkdir()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
           "--artifacts-destination", str(store / "artifacts")]
    log_path = store / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=store, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def kill():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the server and its workers
        proc.wait(timeout=30)

    try:
        uri = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90  # about 23 s on 2 cores (docs/design.md, section 4)
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer /health in 90 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri, store / "artifacts", kill
    finally:
        kill()


@pytest.mark.slow
def test_real_server_then_server_dies(tmp_path, mlflow_server, caplog):
    from mlflow.tracking import MlflowClient

    uri, artifacts, kill = mlflow_server
    tracker = Tracker(uri, experiment="server-exp", run_name="remote", run_dir=tmp_path / "run")
    with tracker:
        assert tracker.active
        _log_everything(tracker, tmp_path)
        run_id = tracker.run_id
        assert tracker.location.startswith(f"{uri}/#/experiments/") and run_id in tracker.location

        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(run_id)
        assert run.info.run_name == "remote" and run.info.status == "RUNNING"
        assert run.data.params == {"model.layers": "2", "a": "1"} and run.data.tags["k"] == "v"
        assert _history(client, run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
        assert _artifacts(client, run_id) == {"config.yaml", "note.txt", "figures/curve.png"}
        assert len(list(artifacts.rglob("curve.png"))) == 1  # proxied into the server's folder
        assert _warnings(caplog) == []

        kill()
        t0 = time.perf_counter()
        tracker.log_metrics({"loss": 0.1}, step=4)  # must not raise
        assert tracker.active and tracker.run_id != run_id  # now in the run folder's store
        tracker.log_metrics({"loss": 0.05}, step=5)
        tracker.log_artifact(tmp_path / "note.txt")
        assert time.perf_counter() - t0 < 15
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and uri in warnings[0] and "mlflow ui --backend-store-uri sqlite:///" in warnings[0]
    local = _local_client(tmp_path / "run")
    # every point of the session, those the server got before it died included
    assert _history(local, tracker.run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.1), (5, 0.05)]
    run = local.get_run(tracker.run_id)
    assert run.data.params == {"model.layers": "2", "a": "1"} and run.data.tags["genome_lm.fallback_from"] == uri
    assert {"config.yaml", "note.txt"} <= _artifacts(local, tracker.run_id)


def test_rewind_drops_the_points_after_a_checkpoint(tmp_path):
    """A run killed after step 6 and resumed from its step-4 checkpoint: the steps 5-6 logged
    before the kill are gone, the history up to 4 and the params, tags and artifacts are kept."""
    with Tracker(None, experiment="exp", run_name="r", run_dir=tmp_path) as tracker:
        _log_everything(tracker, tmp_path)  # steps 1-3
        for step in (4, 5, 6):
            tracker.log_metrics({"loss": 1.0 / step}, step=step)
        first = tracker.run_id
    with Tracker(None, experiment="exp", run_dir=tmp_path, run_id=first) as tracker:
        tracker.rewind(4)
        for step in (5, 6, 7):
            tracker.log_metrics({"loss": 2.0 / step}, step=step)
        second = tracker.run_id
    client = _local_client(tmp_path)
    assert second != first and client.get_run(first).info.lifecycle_stage == "deleted"
    run = client.get_run(second)
    assert run.info.run_name == "r" and run.data.tags["genome_lm.continues_run"] == first
    assert run.data.params == {"model.layers": "2", "a": "1"} and run.data.tags["k"] == "v"
    assert [s for s, _ in _history(client, second, "loss")] == [1, 2, 3, 4, 5, 6, 7]  # each step once
    assert _history(client, second, "loss")[4] == (5, 2.0 / 5)
    assert _artifacts(client, second) == {"config.yaml", "note.txt", "figures/curve.png"}
    # nothing after the step: the same run goes on
    with Tracker(None, experiment="exp", run_dir=tmp_path, run_id=second) as tracker:
        tracker.rewind(7)
        assert tracker.run_id == second


def test_a_moved_run_folder_writes_only_into_itself(tmp_path):
    import shutil

    original = tmp_path / "a" / "run"
    with Tracker(None, experiment="exp", run_dir=original) as tracker:
        _log_everything(tracker, tmp_path)
        run_id = tracker.run_id
    copy = tmp_path / "b" / "run"
    shutil.copytree(original, copy)
    before = sorted(p.relative_to(original) for p in original.rglob("*"))
    note = tmp_path / "later.txt"
    note.write_text("y")
    with Tracker(None, experiment="exp", run_dir=copy, run_id=run_id) as tracker:
        tracker.log_artifact(note)
    with Tracker(None, experiment="exp", run_dir=copy) as tracker:  # a new run in the copy
        tracker.log_artifact(note)
        new_id = tracker.run_id
    assert sorted(p.relative_to(original) for p in original.rglob("*")) == before  # nothing written there
    client = _local_client(copy)
    assert "later.txt" in _artifacts(client, run_id) and "later.txt" in _artifacts(client, new_id)
    assert len(list((copy / "mlartifacts").rglob("later.txt"))) == 2
    assert client.get_experiment_by_name("exp").artifact_location == (copy / "mlartifacts").as_uri()


def test_experiment_opens_on_model_training(tmp_path):
    with Tracker(None, experiment="kind", run_dir=tmp_path):
        pass
    experiment = _local_client(tmp_path).get_experiment_by_name("kind")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_read_run_gives_back_what_was_logged(tmp_path):
    from genome_lm.errors import GenomeLMError
    from genome_lm.tracking import read_run

    note = tmp_path / "note.txt"
    note.write_text("hello\n")
    with Tracker(None, experiment="exp", run_name="r", run_dir=tmp_path) as tracker:
        tracker.log_params({"lr": 0.5, "nested": {"a": 1}})
        tracker.log_metrics({"loss": 2.5}, step=3)
        tracker.set_tags({"kind": "eval"})
        tracker.log_artifact(note)
    got = read_run(tracker.tracking_uri, tracker.run_id)
    assert got["run_id"] == tracker.run_id and got["parent_run_id"] is None
    assert got["metrics"] == {"loss": 2.5}
    assert got["params"]["lr"] == "0.5" and got["tags"]["kind"] == "eval"
    assert "note.txt" in got["artifacts"]
    with pytest.raises(GenomeLMError, match="cannot give the run: run 0123abcd") as err:
        read_run(tracker.tracking_uri, "0123abcd")
    assert "\n" not in str(err.value)


def test_read_run_from_an_unreachable_server_is_one_line_in_seconds():
    from genome_lm.errors import GenomeLMError
    from genome_lm.tracking import read_run

    uri = f"http://127.0.0.1:{_free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(GenomeLMError, match=f"{uri} is unavailable: run abc") as err:
        read_run(uri, "abc")
    assert time.perf_counter() - t0 < 15 and "\n" not in str(err.value)
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_the_printed_mlflow_command_runs_without_an_activated_environment(monkeypatch, tmp_path):
    """A virtual environment that was never activated has no ``mlflow`` on PATH: the command names
    the one beside this Python; with ``mlflow`` on PATH, the bare name."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "mlflow").write_text("#!/bin/sh\n")
    (bin_dir / "mlflow").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert tracking.mlflow_command() == str(bin_dir / "mlflow")
    monkeypatch.setenv("PATH", str(bin_dir))
    assert tracking.mlflow_command() == "mlflow"



def test_a_new_store_says_nothing_of_its_database_tables(tmp_path, capfd):
    """A first run in a folder creates MLflow's tables: MLflow's own INFO lines about it are not
    the user's business (they used to open every demo's output)."""
    with Tracker(None, experiment="exp", run_name="r", run_dir=tmp_path / "run") as tracker:
        assert tracker.active
    captured = capfd.readouterr()
    assert "database tables" not in captured.err + captured.out
