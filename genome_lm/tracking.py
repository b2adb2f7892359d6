"""Experiment tracking: the one module that knows MLflow exists.

The trainer and the evaluator log through :class:`Tracker`; everything it returns is a plain
string or dict. Design rules:

* **Default store**: with no ``tracking_uri`` a run is recorded in ``sqlite:///<run_dir>/mlflow.db``
  with artifacts in ``<run_dir>/mlartifacts`` (SQLite, not ``./mlruns``: MLflow 3 deprecates the
  file store). No server is needed; ``tracker.location`` prints the ``mlflow ui`` command to open it.
* **Tracking never stops training, and never loses its metrics.** If a tracking server cannot be
  reached (it does not answer when the run starts, or goes away mid-run), the tracker moves to
  the run folder's own store (``sqlite:///<run_dir>/mlflow.db``), replays there everything this
  session logged (params, tags, config, every metric point), says so once with the command that
  opens it, and carries on there. Only if that store fails too does tracking stop (one warning).
  Any other failed call (a value the store refuses, a locked database) drops that call only: the
  first is reported, the count at :meth:`Tracker.close`.
* **A run folder is movable.** The default store keeps absolute artifact locations; when it is
  opened from another folder (the run folder was copied or moved), they are re-pointed to the
  folder it is in now, so a copy never writes into the original.
* **Resuming repeats no step**: :meth:`Tracker.rewind` drops the metric points logged after the
  checkpoint a run resumes from (a run that holds such points is continued in a new run with the
  history up to the checkpoint, and the old one is deleted; MLflow cannot delete single points).
* **The experiment opens on its training runs**: it is tagged ``mlflow.experimentKind`` =
  ``custom_model_development`` (MLflow 3 otherwise opens its GenAI overview).
* **Short network timeouts**: for http(s) stores each call runs with ``MLFLOW_HTTP_REQUEST_TIMEOUT``
  = ``timeout_s`` (5 s) and one quick retry, unless the user set those variables, so an unreachable
  server costs seconds, not MLflow's default minutes of back-off.
* **Rank awareness**: ``enabled=False`` (non-zero ranks) never imports MLflow; every call returns
  at once.
* **Params are write-once in MLflow**: values are stringified and cut to 500 characters (the
  smallest limit any MLflow server enforces; ``config.yaml`` keeps the full config); a key logged
  again with a different value (``checkpoint`` after a resume) is stored as a tag of that name.
* Non-finite metric values are skipped (one note per run), not sent: MLflow stores them, but they
  break plots and comparisons.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from genome_lm.errors import GenomeLMError
from genome_lm.mlflow_store import repoint_moved_store

log = logging.getLogger(__name__)

PARAM_VALUE_LIMIT = 500  # MLflow < 2.8 servers refuse longer param values (newer ones allow 6000)
TAG_VALUE_LIMIT = 5000  # likewise for tags (8000 in newer servers)
KEY_LIMIT = 250
_BATCH = 100  # params or tags per request (MLflow's MAX_PARAMS_TAGS_PER_BATCH)
_METRIC_BATCH = 1000
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


class Tracker:
    """One tracked run. Use as a context manager (or call :meth:`close`) so the run is ended.

    Args:
        tracking_uri: where runs go: ``http(s)://host:port`` for a tracking server, any other
            MLflow store URI, or None for ``sqlite:///<run_dir>/mlflow.db``.
        experiment: experiment name, created when missing.
        run_name: shown in the UI; ignored when resuming.
        run_dir: the run's output folder (holds the default store); defaults to the working folder.
        run_id: continue logging into this existing run (training resume). When the store does not
            know it (the URI changed), a new run is started, tagged ``genome_lm.resumed_from``.
        enabled: False on non-zero ranks: every call is a no-op.
        timeout_s: per-request network timeout for http(s) stores.
    """

    def __init__(self, tracking_uri: str | None = None, *, experiment: str = "genome-lm",
                 run_name: str | None = None, run_dir: str | Path | None = None, run_id: str | None = None,
                 enabled: bool = True, timeout_s: float = 5.0, start_time_ms: int | None = None):
        self.enabled = enabled
        self._active = False
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._history: list = []  # this session's metric points, replayed into a fallback store
        self._config_tree: Any = None
        self._noted: set[str] = set()
        self._dropped = 0
        self._closed = False
        if not enabled:
            self.tracking_uri = tracking_uri or ""
            return
        folder = Path(run_dir if run_dir is not None else ".").resolve()
        self._folder, self._experiment_name, self._run_name = folder, experiment, run_name
        self._start_time_ms = start_time_ms
        self._default_store = tracking_uri is None
        self.tracking_uri = tracking_uri or local_store(folder)
        self._timeout_s = timeout_s
        try:
            with self._network():
                self._start(experiment, run_name, run_id, folder)
            self._active = True
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            self._warn_unavailable(err)

    # -- set-up -------------------------------------------------------------------------------

    def _start(self, experiment: str, run_name: str | None, run_id: str | None, folder: Path) -> None:
        from mlflow.tracking import MlflowClient

        # a new store's "Creating initial MLflow database tables..." is MLflow's business, not the user's
        for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
            logging.getLogger(name).setLevel(logging.WARNING)
        if self._default_store:
            folder.mkdir(parents=True, exist_ok=True)
            repoint_moved_store(folder / "mlflow.db")
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        if run_id is not None:
            run = self._find_run(run_id)
            if run is not None:
                self._run_id, self._experiment_id = run.info.run_id, run.info.experiment_id
                self._params = dict(run.data.params)
                self._client.update_run(self._run_id, status="RUNNING")
                return
            self._note("resume", f"tracking: run {run_id} is not in {self.tracking_uri}; starting a new run")
        self._experiment_id = self._experiment(experiment)
        tags = {"genome_lm.resumed_from": run_id} if run_id else None
        run = self._client.create_run(self._experiment_id, run_name=run_name, tags=tags,
                                      start_time=self._start_time_ms)
        self._run_id = run.info.run_id

    def _find_run(self, run_id: str):
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(err).lower():
                return None
            raise

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(name)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                self._client.restore_experiment(found.experiment_id)
            if found.tags.get(EXPERIMENT_KIND_TAG) is None:
                self._client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return found.experiment_id
        try:
            return self._client.create_experiment(name, artifact_location=self._artifact_root(),
                                                  tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException:  # created by another process meanwhile
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _artifact_root(self) -> str | None:
        """Artifacts beside a SQLite file (MLflow would otherwise use ./mlruns of the working folder);
        servers and other stores choose their own."""
        if self.tracking_uri.startswith("sqlite:///") and ":memory:" not in self.tracking_uri:
            db = Path(self.tracking_uri[len("sqlite:///"):])
            return (db.parent / "mlartifacts").as_uri()
        return None

    # -- public API ---------------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The run's id (store it in checkpoints to resume into the same run); None when inactive."""
        return self._run_id if self.enabled else None

    @property
    def active(self) -> bool:
        """True while calls reach the store."""
        return self._active

    @property
    def location(self) -> str:
        """Where a user can look at the run: a URL for servers, an ``mlflow ui`` command otherwise."""
        if not self.enabled or self._run_id is None:
            return ""
        if self.tracking_uri.startswith(("http://", "https://")):
            return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self._experiment_id}/runs/{self._run_id}"
        return (f"{mlflow_command()} ui --backend-store-uri {self.tracking_uri}, then open "
                f"http://127.0.0.1:5000/#/experiments/{self._experiment_id}/runs/{self._run_id}")

    url = location

    def info(self) -> dict[str, str | None]:
        """Plain description of the run, for logs and reports."""
        return {"tracking_uri": self.tracking_uri if self.enabled else None, "run_id": self.run_id,
                "experiment_id": self._experiment_id if self.enabled else None, "location": self.location}

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nested mappings are flattened with dots (``model.layers``); values become strings."""
        if not self._active:
            return
        new, changed = {}, {}
        for key, value in flatten(params).items():
            key = _key(key)
            value = _cut(_text(value), PARAM_VALUE_LIMIT)
            if key not in self._params:
                new[key] = value
            elif self._params[key] != value:
                changed[key] = value
        if changed:
            log.debug("tracking: params %s changed; the new values are stored as tags", sorted(changed))
        self._params.update(new)
        self._tags.update(changed)
        self._batch(params=new, tags=changed)

    def log_config(self, config: Any, name: str = "config.yaml") -> None:
        """The resolved config (mapping, dataclass or pydantic model) as ``config.yaml`` and as params."""
        if not self._active:
            return
        tree = self._config_tree = _plain(config)
        with tempfile.TemporaryDirectory(prefix="genome-lm-tracking-") as tmp:
            path = Path(tmp) / name
            path.write_text(yaml.safe_dump(tree, sort_keys=False))
            self.log_artifact(path)
        self.log_params(tree)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Numbers (ints, floats, numpy or 0-d torch scalars); non-finite values are skipped."""
        if not self._active:
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            value = float(value)
            if not math.isfinite(value):
                self._note("nonfinite", f"tracking: metric {key}={value} at step {step} not logged "
                                        "(non-finite values are skipped; noted once per run)")
                continue
            batch.append(Metric(_key(key), value, stamp, int(step or 0)))
        self._history.extend(batch)
        for i in range(0, len(batch), _METRIC_BATCH):
            self._call(self._client.log_batch, self._run_id, metrics=batch[i:i + _METRIC_BATCH])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self._active:
            tags = {_key(k): _cut(_text(v), TAG_VALUE_LIMIT) for k, v in tags.items()}
            self._tags.update(tags)
            self._batch(tags=tags)

    def rewind(self, step: int) -> None:
        """Forget the metric points after ``step``: a run resumed from the checkpoint of ``step``
        logs those steps again. When the run holds any, it goes on in a new run that gets the
        original's params, tags, artifacts and metric history up to ``step`` (tagged
        ``genome_lm.continues_run``), and the original is deleted (MLflow keeps deleted runs until
        ``mlflow gc``). Nothing happens when no point lies beyond ``step``."""
        if not self._active:
            return
        try:
            with self._network():
                self._continue_without_points_after(step)
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            if _unreachable(err):
                self._warn_unavailable(err)
            else:
                self._note("rewind", f"tracking: could not drop the metric points after step {step} ({_short(err)}); "
                                     "they will appear twice")

    def _continue_without_points_after(self, step: int) -> None:
        from mlflow.entities import Param

        old = self._client.get_run(self._run_id)
        history = {key: self._client.get_metric_history(self._run_id, key) for key in old.data.metrics}
        if not any(m.step > step for points in history.values() for m in points):
            return
        user_tags = {k: v for k, v in old.data.tags.items() if not k.startswith("mlflow.")}
        run = self._client.create_run(old.info.experiment_id, run_name=old.info.run_name,
                                      start_time=old.info.start_time,
                                      tags={**user_tags, "genome_lm.continues_run": old.info.run_id,
                                            "genome_lm.resumed_at_step": str(step)})
        new_id = run.info.run_id
        params = [Param(k, v) for k, v in old.data.params.items()]
        for i in range(0, len(params), _BATCH):
            self._client.log_batch(new_id, params=params[i:i + _BATCH])
        kept = [m for points in history.values() for m in points if m.step <= step]
        for i in range(0, len(kept), _METRIC_BATCH):
            self._client.log_batch(new_id, metrics=kept[i:i + _METRIC_BATCH])
        with tempfile.TemporaryDirectory(prefix="genome-lm-tracking-") as tmp:
            if self._client.list_artifacts(old.info.run_id):
                local = self._client.download_artifacts(old.info.run_id, "", tmp)
                self._client.log_artifacts(new_id, local)
        self._client.delete_run(old.info.run_id)
        self._run_id = new_id
        self._params = dict(old.data.params)
        self._history = [m for m in self._history if m.step <= step]
        self._client.set_tag(new_id, "genome_lm.note",
                             f"continues run {old.info.run_id} (deleted), resumed at step {step}")

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file or a folder into the run's artifacts (under ``artifact_path`` when given)."""
        if not self._active:
            return
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file to log as an artifact")
        if path.is_dir():
            self._call(self._client.log_artifacts, self._run_id, str(path), artifact_path)
        else:
            self._call(self._client.log_artifact, self._run_id, str(path), artifact_path)

    def log_figure(self, figure: Any, name: str) -> None:
        """A matplotlib figure (anything with ``savefig``) or a PNG file, as ``figures/<name>``."""
        if not self._active:
            return
        name = name if Path(name).suffix else f"{name}.png"
        with tempfile.TemporaryDirectory(prefix="genome-lm-tracking-") as tmp:
            target = Path(tmp) / name
            if hasattr(figure, "savefig"):
                figure.savefig(target, dpi=120, bbox_inches="tight")
            else:
                shutil.copyfile(figure, target)
            self.log_artifact(target, "figures")

    def close(self, status: str = "FINISHED") -> None:
        """End the run (status FINISHED, FAILED or KILLED); later calls are no-ops."""
        if self._closed:
            return
        self._closed = True
        if self._active:
            self._call(self._client.set_terminated, self._run_id, status)
            self._active = False
        if self._dropped > 1:
            log.warning("tracking: %d calls to %s failed and were dropped", self._dropped, self.tracking_uri)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("FINISHED")
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # -- plumbing -----------------------------------------------------------------------------

    def _batch(self, params: Mapping[str, str] | None = None, tags: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        params = [Param(k, v) for k, v in (params or {}).items()]
        tags = [RunTag(k, v) for k, v in (tags or {}).items()]
        for i in range(0, max(len(params), len(tags)), _BATCH):
            self._call(self._client.log_batch, self._run_id, params=params[i:i + _BATCH], tags=tags[i:i + _BATCH])

    def _call(self, fn, *args, **kwargs) -> None:
        if not self._active:
            return
        try:
            with self._network():
                fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            if _unreachable(err):
                self._warn_unavailable(err)
            else:
                self._dropped += 1
                self._note("dropped", f"tracking: a call to {self.tracking_uri} failed and was dropped "
                                      f"({_short(err)}); training continues")

    def _warn_unavailable(self, err: Exception) -> None:
        if not self._default_store and self._fall_back(err):
            return
        self._active = False
        self._note("unavailable", f"tracking: {self.tracking_uri} is unavailable ({_short(err)}); "
                                  "training continues without tracking")

    def _fall_back(self, err: Exception) -> bool:
        """Move to the run folder's own store and replay this session there (see the module
        docstring); False when that store cannot be opened either."""
        lost = self.tracking_uri
        self.tracking_uri, self._default_store = local_store(self._folder), True
        self._active = False
        try:
            self._start(self._experiment_name, self._run_name, None, self._folder)
        except Exception as again:  # noqa: BLE001
            self._note("unavailable", f"tracking: {lost} is unavailable ({_short(err)}) and so is the run folder's "
                                      f"store {self.tracking_uri} ({_short(again)}); training continues without "
                                      "tracking")
            return True
        self._active = True
        self._note("fallback", f"tracking: {lost} is unavailable ({_short(err)}); logging to the run folder's store "
                               f"instead, with everything this session had logged: {mlflow_command()} ui "
                               f"--backend-store-uri {self.tracking_uri}")
        tags = {**self._tags, "genome_lm.fallback_from": lost}
        self._batch(params=self._params, tags=tags)
        if self._config_tree is not None:
            with tempfile.TemporaryDirectory(prefix="genome-lm-tracking-") as tmp:
                path = Path(tmp) / "config.yaml"
                path.write_text(yaml.safe_dump(self._config_tree, sort_keys=False))
                self.log_artifact(path)
        for i in range(0, len(self._history), _METRIC_BATCH):
            self._call(self._client.log_batch, self._run_id, metrics=self._history[i:i + _METRIC_BATCH])
        return True

    def _note(self, kind: str, message: str) -> None:
        if kind not in self._noted:
            self._noted.add(kind)
            log.warning("%s", message)

    def _network(self):
        return _network(self.tracking_uri, self._timeout_s)


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's view for model training (not its GenAI overview)


def mlflow_command() -> str:
    """``mlflow`` when it is on PATH, else the one installed beside this Python (a virtual
    environment that was not activated), so the printed command runs as it is."""
    beside = Path(sys.executable).parent / "mlflow"
    if shutil.which("mlflow") or not beside.exists():
        return "mlflow"
    return str(beside)


def local_store(folder: Path) -> str:
    """The run folder's own MLflow store."""
    return f"sqlite:///{Path(folder) / 'mlflow.db'}"


@contextmanager
def _network(uri: str, timeout_s: float) -> Iterator[None]:
    """Short timeouts for requests to an http(s) store (MLflow reads them from the environment at
    each request), unless the user set them; urllib3's retry chatter is kept off the console."""
    if not uri.startswith(("http://", "https://")):
        yield
        return
    env = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(timeout_s))),
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
           "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
           "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}
    added = [k for k in env if k not in os.environ]
    os.environ.update({k: env[k] for k in added})
    pool = logging.getLogger("urllib3.connectionpool")
    level = pool.level
    pool.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pool.setLevel(level)
        for k in added:
            os.environ.pop(k, None)


def read_run(tracking_uri: str, run_id: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """A logged run as plain data: {run_id, parent_run_id, metrics, params, tags, artifacts}.
    Raises ``GenomeLMError`` (one line, naming the store) when the store cannot be reached or
    does not hold the run."""
    from mlflow.tracking import MlflowClient

    try:
        with _network(tracking_uri, timeout_s):
            client = MlflowClient(tracking_uri=tracking_uri)
            run = client.get_run(run_id)
            artifacts = [a.path for a in client.list_artifacts(run_id)]
    except Exception as err:  # noqa: BLE001 - reported as one line
        what = "is unavailable" if _unreachable(err) else "cannot give the run"
        raise GenomeLMError(f"{tracking_uri} {what}: run {run_id} ({_short(err)})") from None
    return {"run_id": run.info.run_id, "parent_run_id": run.data.tags.get("mlflow.parentRunId"),
            "metrics": dict(run.data.metrics), "params": dict(run.data.params), "tags": dict(run.data.tags),
            "artifacts": artifacts}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _plain(obj: Any) -> Any:
    """Config objects to YAML/JSON-safe trees."""
    if hasattr(obj, "model_dump"):
        return _plain(obj.model_dump(mode="json"))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _plain(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, Mapping)):
        return json.dumps(_plain(value))
    return str(value)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key(key: str) -> str:
    """A name MLflow accepts: allowed characters only, no empty or ``..`` path parts."""
    parts = [p for p in _BAD_KEY_CHARS.sub("_", str(key)).split("/") if p not in ("", ".", "..")]
    return "/".join(parts)[:KEY_LIMIT] or "_"


def _short(err: Exception) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return _cut(f"{type(err).__name__}: {text}", 240)


def _unreachable(err: Exception) -> bool:
    """Connection refused, timed out, or retries used up: MLflow wraps these as 'API request to
    <url> failed with (timeout) exception ...'."""
    import requests

    if isinstance(err, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError,
                        TimeoutError)):
        return True
    text = str(err)
    return text.startswith("API request to") and ("failed with exception" in text or "failed with timeout" in text)
