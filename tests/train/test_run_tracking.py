"""What a training run leaves in MLflow, read back with MLflow's own client: the resolved config as
params and as config.yaml, every per-step metric, the loss curve, the checkpoint path; with an
unreachable server the run still trains and says so once; with a real `mlflow server` the metrics
land there."""

import logging

import pytest
import yaml

from genome_lm.config import load_config
from genome_lm.train.trainer import StepMetrics, train

# the real-server fixture, and the autouse fixture that keeps MLflow quiet and off the environment's URI
from tests.test_tracking import _free_port, _quiet_mlflow, mlflow_server  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

STEPS = 3
METRICS = ("loss", "lm_loss", "indexer_loss", "lr", "grad_norm", "tokens_per_s", "step_seconds", "peak_host_mib",
           "peak_device_mib", "moe_busiest_expert_over_mean", "skipped", "tflops_per_gpu", "mfu")


def _config(dataset, out, extra=()):
    return load_config("demo-cpu", [f"data.dataset={dataset}", f"train.out_dir={out}", f"train.steps={STEPS}",
                                    "data.seq_len=128", "train.global_batch_size=2", "train.warmup_steps=1",
                                    "train.indexer_dense_steps=1", "train.save_every=0",
                                    "model.kernel_backend=torch", "tracking.experiment=tracked", *extra])


def _artifacts(client, run_id, path=None):
    out = set()
    for item in client.list_artifacts(run_id, path):
        out |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return out


def _check_metrics(client, result):
    expected = {m.step: m.as_metrics() for m in result.history}
    assert set(METRICS) <= set(expected[1]), "the trainer's metric names changed; update METRICS"
    for name in METRICS:
        history = sorted((h.step, h.value) for h in client.get_metric_history(result.run_id, name))
        assert [s for s, _ in history] == list(range(1, STEPS + 1)), name
        assert [v for _, v in history] == pytest.approx([expected[s][name] for s, _ in history], rel=1e-6), name
    return {name: [h.value for h in sorted(client.get_metric_history(result.run_id, name), key=lambda h: h.step)]
            for name in METRICS}


def test_local_run_records_config_metrics_curve_and_checkpoint(small_dataset, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    cfg = _config(small_dataset, out, ["train.lr=2e-3", "data.softmask_weight=0.25"])
    result = train(cfg, progress=False)
    assert result.steps_done == STEPS and result.run_id
    assert result.checkpoint == out / "checkpoints" / f"step-{STEPS:06d}" and result.checkpoint.is_dir()

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == f"demo-cpu: tiny ({out})"  # config, preset, folder
    assert client.get_experiment(run.info.experiment_id).name == "tracked"
    params = run.data.params
    # the resolved config, overrides and defaults alike
    assert params["train.lr"] == "0.002" and params["data.softmask_weight"] == "0.25"
    assert params["train.steps"] == str(STEPS) and params["data.seq_len"] == "128"
    assert params["model.preset"] == "tiny" and params["model.kernel_backend"] == "torch"
    assert params["memory.recompute"] == "none" and params["train.global_batch_size"] == "2"
    # the backend profile the run resolved (genome_lm.engine.backend), the CPU one here
    assert params["backend.profile"] == "cpu" and params["backend.optimizer"] == "cpu-adamw"
    assert params["backend.moe_dispatcher"] == "allgather" and params["backend.process_groups"] == "gloo"
    assert params["data.dataset"] == str(small_dataset) and params["train.out_dir"] == str(out)
    # the checkpoint path, equal to the returned one
    assert params["checkpoint"] == str(result.checkpoint)

    values = _check_metrics(client, result)
    from genome_lm.train.optim import learning_rate

    assert values["lr"] == pytest.approx([learning_rate(s, cfg.train) for s in range(STEPS)], rel=1e-6)
    assert max(values["lr"]) <= 2e-3
    assert all(v > 0 for v in values["tokens_per_s"]) and all(v > 0 for v in values["step_seconds"])
    # TFLOP/s per GPU: the step's model FLOPs (model.flops) over its time; MFU against this CPU's
    # measured matmul rate, a fraction
    from genome_lm.model.flops import model_flops
    from genome_lm.plan.memory_model import model_config

    for m, mode in zip(result.history, ["dense"] + ["sparse"] * (STEPS - 1)):
        per_step = 2 * model_flops(model_config(cfg), cfg.memory, T=128, indexer_loss_mode=mode)
        assert m.tflops_per_gpu == pytest.approx(per_step / m.seconds / 1e12, rel=1e-6)
    assert all(0 < v < 1 for v in values["mfu"])
    assert all(v > 0 for v in values["peak_host_mib"]) and all(v >= 0 for v in values["peak_device_mib"])
    assert all(v >= 1.0 for v in values["moe_busiest_expert_over_mean"])  # busiest expert / mean
    assert all(v > 0 for v in values["grad_norm"]) and all(v > 0 for v in values["lm_loss"])

    artifacts = _artifacts(client, result.run_id)
    assert {"config.yaml", "loss_curve.png"} <= artifacts, artifacts
    local = client.download_artifacts(result.run_id, "config.yaml", str(tmp_path / "dl"))
    assert yaml.safe_load(open(local)) == cfg.resolved()
    png = client.download_artifacts(result.run_id, "loss_curve.png", str(tmp_path / "dl"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_trains_into_the_run_folders_store(small_dataset, tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        result = train(_config(small_dataset, out), progress=False, tracking_uri=uri)
    assert result.steps_done == STEPS and len(result.history) == STEPS
    assert result.checkpoint == out / "checkpoints" / f"step-{STEPS:06d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == result.checkpoint.name
    naming = [r.getMessage() for r in caplog.records if uri in r.getMessage()]
    assert len(naming) == 1, naming
    assert "\n" not in naming[0] and "unavailable" in naming[0] and "mlflow ui --backend-store-uri" in naming[0]
    assert f"mlflow ui --backend-store-uri sqlite:///{out / 'mlflow.db'}," in result.tracking
    _check_metrics(MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}"), result)
    assert (out / "loss_curve.png").exists()


@pytest.mark.slow
def test_server_stopped_mid_run_loses_no_metric(small_dataset, tmp_path, mlflow_server, caplog):  # noqa: F811
    """A real `mlflow server` killed after the run logged its second step: training finishes and
    the run folder's store holds every step's metrics, the ones the server had got included."""
    import threading
    import time

    from mlflow.tracking import MlflowClient

    uri, _, kill = mlflow_server
    out = tmp_path / "run"
    server = MlflowClient(tracking_uri=uri)
    stop = threading.Event()

    def kill_after_two_steps():
        while not stop.is_set():
            runs = server.search_runs([e.experiment_id for e in server.search_experiments()])
            if runs and len(server.get_metric_history(runs[0].info.run_id, "loss")) >= 2:
                kill()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=kill_after_two_steps, daemon=True)
    watcher.start()
    steps = 8
    try:
        with caplog.at_level(logging.WARNING):
            result = train(_config(small_dataset, out, [f"train.steps={steps}"]), progress=False, tracking_uri=uri)
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert result.steps_done == steps
    warned = [r.getMessage() for r in caplog.records if uri in r.getMessage()]
    assert len(warned) == 1 and "mlflow ui --backend-store-uri" in warned[0]
    local = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    history = sorted((h.step, h.value) for h in local.get_metric_history(result.run_id, "lm_loss"))
    assert [s for s, _ in history] == list(range(1, steps + 1))
    assert [v for _, v in history] == pytest.approx([m.lm_loss for m in result.history], rel=1e-6)
    run = local.get_run(result.run_id)
    assert run.data.tags["genome_lm.fallback_from"] == uri and run.data.params["data.seq_len"] == "128"


@pytest.mark.slow
def test_training_against_a_real_mlflow_server(small_dataset, tmp_path, mlflow_server, caplog):  # noqa: F811
    from mlflow.tracking import MlflowClient

    uri, artifacts, _ = mlflow_server
    with caplog.at_level(logging.WARNING):
        result = train(_config(small_dataset, tmp_path / "run"), progress=False, tracking_uri=uri)
    assert not [r for r in caplog.records if r.name == "genome_lm.tracking"]
    assert result.tracking.startswith(f"{uri}/#/experiments/") and result.run_id in result.tracking
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["checkpoint"] == str(result.checkpoint)
    assert run.data.params["data.seq_len"] == "128"
    _check_metrics(client, result)
    assert {"config.yaml", "loss_curve.png"} <= _artifacts(client, result.run_id)
    assert len(list(artifacts.rglob("loss_curve.png"))) == 1  # proxied into the server's folder
    assert not (tmp_path / "run" / "mlflow.db").exists()


def test_metric_names_are_those_of_step_metrics():
    """The names this file checks are what the trainer logs (and nothing it logs is unchecked here
    but the optional MoE auxiliary loss)."""
    m = StepMetrics(1, 1.0, 1.0, 0.0, 1e-3, 1.0, 10, 0.5, False, 1.0, 0.0, 1.0)
    assert set(m.as_metrics()) == set(METRICS)
