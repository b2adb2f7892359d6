"""genome_lm.mlflow_store, the MLflow internals genome-lm relies on, pinned: the installed MLflow
is the release family it was written for, a store MLflow creates has the tables and columns it
rewrites, MLflow still keeps the per-process cache it clears, and a moved run folder's store
points at its new artifact folder afterwards (the runs' artifacts readable through MLflow)."""

import shutil
import sqlite3

import mlflow
from mlflow.tracking import MlflowClient

from genome_lm import mlflow_store


def test_the_installed_mlflow_is_the_one_it_was_written_for():
    assert mlflow.__version__.startswith(mlflow_store.WRITTEN_FOR), (
        f"MLflow {mlflow.__version__}: genome_lm/mlflow_store.py was written for {mlflow_store.WRITTEN_FOR}x; "
        "check its SQL and cache against this release, then update WRITTEN_FOR")
    from mlflow.tracking._tracking_service import utils

    assert isinstance(utils._artifact_repos_cache, dict) or hasattr(utils._artifact_repos_cache, "pop")


def _columns(db, table):
    with sqlite3.connect(db) as con:
        return {row[1] for row in con.execute(f"PRAGMA table_info({table})")}


def test_a_moved_store_points_at_its_new_folder(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    client = MlflowClient(tracking_uri=f"sqlite:///{old / 'mlflow.db'}")
    exp = client.create_experiment("x", artifact_location=(old / "mlartifacts").as_uri())
    run = client.create_run(exp)
    (tmp_path / "note.txt").write_text("hello")
    client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
    assert {"artifact_location"} <= _columns(old / "mlflow.db", "experiments")
    assert {"artifact_uri", "run_uuid"} <= _columns(old / "mlflow.db", "runs")
    new = tmp_path / "new"
    shutil.copytree(old, new)
    shutil.rmtree(old)
    mlflow_store.repoint_moved_store(new / "mlflow.db")
    moved = MlflowClient(tracking_uri=f"sqlite:///{new / 'mlflow.db'}")
    info = moved.get_run(run.info.run_id).info
    assert info.artifact_uri.startswith((new / "mlartifacts").resolve().as_uri())
    assert [f.path for f in moved.list_artifacts(run.info.run_id)] == ["note.txt"]
    mlflow_store.repoint_moved_store(new / "mlflow.db")  # a second time changes nothing
    assert moved.get_run(run.info.run_id).info.artifact_uri == info.artifact_uri
