"""`genome-lm eval` end to end on a small trained run: buckets, bootstrap, baseline, files, MLflow."""

import csv
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.data.loader import SplitReader
from genome_lm.data.tokenizer import N
from genome_lm.eval.schema import SCHEMA

runner = CliRunner()


def test_report_files_and_schema(evaluated):
    out, report, output = evaluated
    assert report["schema"] == SCHEMA
    assert report["data"]["chrom"] == "chr22" and len(report["data"]["windows"]) == 4
    assert report["settings"]["edges"] == [0, 128, 256, 512, 1024]  # 1 kbp windows: powers of two from 1024 / 8
    assert set(report["results"]) == {"model", "baseline", "uniform", "markov"}
    assert report["models"]["model"]["kind"] == "checkpoint" and report["models"]["baseline"]["kind"] == "init"
    assert report["models"]["uniform"]["kind"] == report["models"]["markov"]["kind"] == "baseline"
    for name in ("eval.json", "eval.csv", "loss_by_context.png", "planted_copies.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss_by_context.png").read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader((out / "eval.csv").open()))
    assert len(rows) == 4 * (3 + 4)
    assert {r["subset"] for r in rows} == {"all", "unmasked", "softmasked", "bucket"}
    assert "by preceding context" in output and "--baseline (the run's starting weights)" in " ".join(output.split())
    assert not list(out.glob(".*tmp*"))  # no temporary file left behind


def test_bucket_counts_match_the_tokens(evaluated, demo_run):
    """Token counts per bucket, and apart for soft-masked bases, recomputed from the dataset."""
    _, report, _ = evaluated
    reader = SplitReader(demo_run / "dataset", "eval")
    edges = report["settings"]["edges"]
    counts = np.zeros(len(edges) - 1, dtype=int)
    soft = 0
    for w in report["data"]["windows"]:
        tokens, mask = reader.tokens(w), reader.softmask(w)
        for j in range(1, len(tokens)):  # base j has j bases of context
            if tokens[j] != N:
                counts[np.searchsorted(edges, j, side="right") - 1] += 1
                soft += bool(mask[j])
    got = [b["tokens"] for b in report["results"]["model"]["buckets"]]
    assert got == counts.tolist()
    assert report["results"]["model"]["softmasked"]["tokens"] == soft
    assert report["results"]["model"]["all"]["tokens"] == counts.sum() == report["data"]["tokens"]


def test_losses_match_a_full_forward_of_the_checkpoint(evaluated, demo_run):
    """The chunked evaluation's mean loss equals one full forward of each window, computed here
    from the checkpoint with plain cross-entropy; the change is (model - baseline) / baseline."""
    from genome_lm.checkpoint import build, latest_checkpoint, load_checkpoint, verify
    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes, parallel_context

    _, report, _ = evaluated
    folder = latest_checkpoint(demo_run / "run")
    cfg = RunConfig.model_validate(verify(folder)["config"], strict=False)
    reader = SplitReader(demo_run / "dataset", "eval")
    total, count, bucket_sum = 0.0, 0, 0.0
    with parallel_context() as pg:
        model = build(cfg, pg, ParallelSizes()).eval()
        load_checkpoint(folder, model, None)
        for w in report["data"]["windows"]:
            ids = torch.from_numpy(reader.tokens(w).astype(np.int64))[None]
            with torch.no_grad():
                nll = torch.nn.functional.cross_entropy(model(ids[:, :-1]).logits[0].float(), ids[0, 1:],
                                                        reduction="none").double()
            keep = ids[0, 1:] != N
            total += nll[keep].sum().item()
            count += int(keep.sum())
            bucket_sum += nll[128 - 1:256 - 1][keep[128 - 1:256 - 1]].sum().item()
    model_stats = report["results"]["model"]
    assert model_stats["all"]["nats"] == pytest.approx(total / count, rel=1e-6)
    assert model_stats["buckets"][1]["nats"] == pytest.approx(bucket_sum / model_stats["buckets"][1]["tokens"],
                                                              rel=1e-6)
    # bits are the same mean in base 2 (against the report's own nats: the independent forward
    # above agrees only to float rounding, about 1e-9 relative)
    assert model_stats["all"]["bits"] == pytest.approx(model_stats["all"]["nats"] / np.log(2), rel=1e-12)
    assert model_stats["all"]["bits"] == pytest.approx(total / count / np.log(2), rel=1e-6)
    lo, hi = model_stats["all"]["nats_ci"]
    assert lo < model_stats["all"]["nats"] < hi
    base = report["results"]["baseline"]["all"]["nats"]
    assert report["comparison"]["all"]["change"] == pytest.approx((model_stats["all"]["nats"] - base) / base)
    clo, chi = report["comparison"]["all"]["ci"]
    assert clo <= report["comparison"]["all"]["change"] <= chi


def test_logged_to_mlflow_as_a_child_of_the_training_run(evaluated, demo_run):
    from mlflow.tracking import MlflowClient

    from genome_lm.checkpoint import latest_checkpoint

    out, report, _ = evaluated
    state = json.loads((latest_checkpoint(demo_run / "run") / "state-r00000.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{demo_run / 'run' / 'mlflow.db'}")
    run = client.get_run(report["mlflow"]["run_id"])
    assert run.data.tags["mlflow.parentRunId"] == state["run_id"]
    assert run.info.experiment_id == client.get_run(state["run_id"]).info.experiment_id
    assert run.data.metrics["eval/model/all_nats"] == pytest.approx(report["results"]["model"]["all"]["nats"])
    series = client.get_metric_history(run.info.run_id, "eval/model/nats_by_context")
    assert sorted(m.step for m in series) == [0, 128, 256, 512]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"eval.json", "eval.csv", "loss_by_context.png"} <= artifacts
    # named after the training run's config and step; its duration spans the scoring (it starts
    # before the first window is scored, not when the results are logged)
    windows = len(report["data"]["windows"])
    assert run.info.run_name == f"eval chr22: demo-cpu step 2 ({windows} windows, vs init, in {out.name})"
    first_scored_ms = min(p.stat().st_mtime for p in (out / ".scores").glob("*/window-*.npy")) * 1000
    assert run.info.start_time <= first_scored_ms <= run.info.end_time


def test_bad_input_is_a_one_line_error_and_writes_nothing(demo_run, tmp_path):
    out = tmp_path / "bad"
    result = runner.invoke(app, ["eval", "--model", str(demo_run / "run"), "--chrom", "chr9", "--out", str(out),
                                 "--quiet", "--no-tracking"])
    assert result.exit_code == 1
    assert "error:" in result.output and "chr9" in result.output and "manifest.json" in result.output
    assert not out.exists()
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "nothing"), "--quiet", "--no-tracking"])
    assert result.exit_code == 1 and "no such model" in result.output
    result = runner.invoke(app, ["eval", "--model", str(demo_run / "run"), "--buckets", "0,8k,4k", "--out", str(out),
                                 "--quiet", "--no-tracking"])
    assert result.exit_code == 1 and "--buckets" in result.output and not out.exists()


def test_eval_straight_from_fasta(evaluated, demo_run, tmp_path):
    """--fasta prepares the chromosome itself: the same windows give the same losses."""
    _, report, _ = evaluated
    out = tmp_path / "fa"
    result = runner.invoke(app, ["eval", "--model", str(demo_run / "run"), "--fasta", str(demo_run / "genome.fa"),
                                 "--chrom", "chr22", "--window", "1k", "--chunk", "0", "--max-windows", "4",
                                 "--resamples", "50", "--out", str(out), "--quiet", "--no-tracking"])
    assert result.exit_code == 0, result.output
    again = json.loads((out / "eval.json").read_text())
    assert (out / "prepared" / "manifest.json").exists()
    assert again["data"]["windows"] == report["data"]["windows"]
    assert again["results"]["model"]["all"]["nats"] == pytest.approx(report["results"]["model"]["all"]["nats"],
                                                                     rel=1e-6)


def test_results_of_another_schema_are_refused(evaluated, tmp_path):
    from genome_lm.errors import GenomeLMError
    from genome_lm.eval.analysis import load_result

    out, report, _ = evaluated
    assert load_result(out / "eval.json").schema == SCHEMA
    other = tmp_path / "old.json"
    other.write_text(json.dumps({**report, "schema": "genome-lm.eval/0"}))
    with pytest.raises(GenomeLMError, match="genome-lm.eval/0"):
        load_result(other)


def test_ctrl_c_says_the_scored_windows_are_kept_and_a_rerun_reuses_them(demo_run, tmp_path, monkeypatch):
    """Ctrl-C after 2 windows: exit 130 with a line naming the kept windows; the same command again
    reuses them and gives the report of an uninterrupted run."""
    from genome_lm.eval.cache import WindowCache

    store, stored = WindowCache.store, []

    def interrupt_after_two(self, window, nll):
        store(self, window, nll)
        stored.append(window)
        if len(stored) == 2:
            raise KeyboardInterrupt

    out = tmp_path / "eval"
    args = ["eval", "--model", str(demo_run / "run"), "--chrom", "22", "--chunk", "256", "--max-windows", "4",
            "--resamples", "50", "--out", str(out), "--quiet", "--no-tracking"]
    monkeypatch.setattr(WindowCache, "store", interrupt_after_two)
    result = runner.invoke(app, args)
    assert result.exit_code == 130
    assert "interrupted: the 2 windows scored so far are kept" in result.output
    assert "will be reused" in result.output and not (out / "eval.json").exists()
    monkeypatch.setattr(WindowCache, "store", store)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "2 of 4 windows already scored" in result.output and "reusing them" in result.output
    assert (out / "eval.json").exists()
