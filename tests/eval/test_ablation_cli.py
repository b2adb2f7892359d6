"""`genome-lm eval --max-context`: the report in every output (table, JSON, CSV, plot, MLflow),
its own score caches, bad input, and the ablation on a real genome from ../shared/data/genomes."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from tests.conftest import shared_genome


@pytest.fixture(scope="module")
def ablated(demo_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation") / "chr22"
    result = CliRunner().invoke(app, ["eval", "--model", str(demo_run / "run"), "--chrom", "22", "--chunk", "256",
                                      "--max-windows", "3", "--resamples", "200", "--max-context", "64,256",
                                      "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "eval.json").read_text()), result.output


@pytest.mark.slow
def test_ablation_in_every_output(ablated, demo_run):
    out, report, text = ablated
    cuts = report["ablation"]["cuts"]
    assert [c["max_context"] for c in cuts] == [64, 256]
    for cut in cuts:
        N = cut["max_context"]
        assert cut["all"]["tokens"] == report["data"]["tokens"]
        for b in cut["buckets"]:
            if b["tokens"] and b["to"] <= N:  # these bases see the same context both ways
                assert abs(b["delta"]) < 1e-5
        assert cut["all"]["ci"][0] <= cut["all"]["delta"] <= cut["all"]["ci"][1]
    assert "context ablation" in text and "context cut to 64" in text
    assert (out / "context_ablation.png").read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader((out / "eval.csv").open()))
    ablation_rows = [r for r in rows if r["max_context"]]
    assert {r["max_context"] for r in ablation_rows} == {"64", "256"}
    assert float(next(r for r in ablation_rows if r["max_context"] == "64" and r["subset"] == "all")
                 ["delta_vs_whole_window"]) == pytest.approx(cuts[0]["all"]["delta"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{demo_run / 'run' / 'mlflow.db'}")
    metrics = client.get_run(report["mlflow"]["run_id"]).data.metrics
    assert metrics["eval/ablation/cut_64/delta_all"] == pytest.approx(cuts[0]["all"]["delta"])


def test_ablation_resumes_from_its_own_scores(ablated, demo_run):
    """Each cut keeps its windows apart from the whole-window scores (its own cache folder)."""
    out, _, _ = ablated
    folders = sorted(p.name.split("-")[1] for p in (out / ".scores").iterdir())
    assert "cut64" in folders and "cut256" in folders


def test_bad_max_context_is_a_one_line_error(demo_run, tmp_path):
    result = CliRunner().invoke(app, ["eval", "--model", str(demo_run / "run"), "--max-context", "1k,lots",
                                      "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "--max-context" in result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_ablation_on_a_real_genome(demo_run, tmp_path):
    """The human mitochondrial genome (16.6 kbp, rCRS), prepared straight from its FASTA."""
    fasta = shared_genome("human_chrM_rCRS.fa")
    out = tmp_path / "chrM"
    result = CliRunner().invoke(app, ["eval", "--model", str(demo_run / "run"), "--fasta", str(fasta), "--chrom",
                                      "MT_human",
                                      "--window", "4k", "--chunk", "1k", "--max-context", "512", "--resamples", "200",
                                      "--out", str(out), "--quiet", "--no-tracking"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    (cut,) = report["ablation"]["cuts"]
    assert cut["max_context"] == 512 and cut["all"]["tokens"] == report["data"]["tokens"] > 10_000
    assert all(abs(b["delta"]) < 1e-5 for b in cut["buckets"] if b["tokens"] and b["to"] <= 512)
