"""What genome-lm does to MLflow beyond its public API, in one place: a run folder's SQLite store
repointed after the folder moved (``repoint_moved_store``).

MLflow has no API to change an experiment's or a run's artifact location, so this writes its
tables (``experiments.artifact_location``, ``runs.artifact_uri``) and drops the moved runs from
its per-process cache of artifact stores (``mlflow.tracking._tracking_service.utils.
_artifact_repos_cache``). Both are MLflow internals: ``WRITTEN_FOR`` names the MLflow releases
this was written and tested against, and ``tests/test_mlflow_store.py`` fails when the installed
MLflow is another one or its tables or cache change.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path

log = logging.getLogger("genome_lm.tracking")

WRITTEN_FOR = "3."  # MLflow 3.x (tested with 3.17)


def repoint_moved_store(db: Path) -> None:
    """When ``db`` (a run folder's MLflow SQLite store) was written in another folder, point its
    artifact locations (the experiments' and the runs', absolute ``file://`` URIs) at the
    ``mlartifacts`` folder beside it, so that a copied or moved run folder is self-contained.
    MLflow has no API to change a location; this updates its tables (``experiments``, ``runs``)
    and drops the runs' artifact stores from MLflow's per-process cache."""
    if not db.is_file():
        return
    here = (db.parent / "mlartifacts").resolve().as_uri()
    with contextlib.closing(sqlite3.connect(db)) as con:
        try:
            rows = con.execute("SELECT artifact_location FROM experiments").fetchall()
        except sqlite3.DatabaseError:
            return  # not (yet) an MLflow store: MLflow itself will say what is wrong
        old_roots = {loc.rsplit("/mlartifacts", 1)[0] + "/mlartifacts" for (loc,) in rows
                     if loc and "/mlartifacts" in loc and not loc.startswith(here)}
        if not old_roots:
            return
        moved_runs = []
        with con:
            for old in old_roots:
                moved_runs += [r for (r,) in con.execute("SELECT run_uuid FROM runs WHERE artifact_uri LIKE ?",
                                                         (old + "%",))]
                for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
                    con.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE {column} LIKE ?",
                                (here, len(old) + 1, old + "%"))
    try:  # MLflow keeps each run's artifact store per process, keyed by run id
        from mlflow.tracking._tracking_service import utils as tracking_utils

        for run_id in moved_runs:
            tracking_utils._artifact_repos_cache.pop(run_id, None)
    except (ImportError, AttributeError):
        pass
    log.info("tracking: %s was moved; artifact locations now point at %s", db, here)
