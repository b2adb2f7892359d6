"""`genome-lm plan`: tables, fit check and suggestion, sweep, published comparison, bad input."""

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.config import load_config
from genome_lm.plan.memory_model import GiB, Hardware, estimate, pinned_size, with_changes
from genome_lm.plan.published import compare
from genome_lm.plan.report import suggest

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["plan", *args], env={"COLUMNS": "200"})


def test_plan_prints_the_budget_and_the_verdict():
    result = invoke("--config", "glm-5.3-flash-1m-64xb200")
    assert result.exit_code == 0, result.output
    for text in ("parameters", "gradients", "optimizer state", "activations at the peak", "KDA + MoE",
                 "DSA + MoE", "host: offloaded activations", "host per node", "activation offload (vs off)"):
        assert text in result.output
    assert "fit" in result.output


def test_cpu_demo_fits_and_options_override_the_config():
    result = invoke("--config", "demo-cpu", "--gpu", "H100", "--seq-len", "64k", "--recompute", "full")
    assert result.exit_code == 0, result.output
    assert "64k tokens" in result.output and "recompute full" in result.output and "fits" in result.output


def test_pipeline_plan_names_the_busiest_stage():
    result = invoke("--config", "demo-cpu", "--device", "cpu", "--pp", "2", "--gpus", "2",
                    "--set", "train.global_batch_size=4")
    assert result.exit_code == 0, result.output
    assert "pp 2 (stage 0, layers 0-1, 2 micro-batches in flight)" in result.output
    assert "stage 0 of 2: backward of layer" in result.output


def test_sweep_has_one_row_per_length():
    result = invoke("--config", "glm-5.3-flash-512k-64xb200", "--sweep")
    assert result.exit_code == 0, result.output
    for label in ("32k", "64k", "128k", "256k", "512k", "1M"):
        assert f"│ {label:>6} │" in result.output


def test_published_comparison_lists_every_figure():
    result = invoke("--published")
    assert result.exit_code == 0, result.output
    assert result.output.count("x") >= 6 and "180.0 GB" in result.output
    rows = compare(Hardware())
    assert len(rows) == 6 and all(planned > 0 for _, planned in rows)
    per_token = next(planned for fig, planned in rows if "per token" in fig.figure)
    assert per_token == pytest.approx(1.4 * 2**20, rel=0.05)  # 45 layers x 4 streams x 4096 x bf16


@pytest.mark.parametrize("args, message", [
    (["--gpu", "A100"], "unknown GPU"),
    (["--gpu-mem", "-3"], "must be positive"),
    (["--tp", "3"], "does not divide"),
    (["--recompute", "some"], "expected none, selective or full"),
    (["--tp", "0"], "parallel.tp"),
    (["--seq-len", "12x"], "not a size"),
    (["--pp", "3"], "pipeline parallel 3 cannot split the 4 layers"),
])
def test_bad_input_is_one_line_and_nonzero(args, message):
    result = invoke("--config", "demo-cpu", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_unknown_or_missing_config_is_an_error():
    result = invoke("--config", "nope")
    assert result.exit_code == 1 and "shipped:" in result.output
    result = invoke()
    assert result.exit_code == 1 and "--config is required" in result.output


def test_a_plan_that_does_not_fit_gets_a_change_that_fits():
    run = with_changes(load_config("demo-cpu"), data={"seq_len": 1 << 20})
    small = Hardware(gpu_name="40 GB", gpu_bytes=40e9)
    plan = estimate(run, small)
    assert not plan.fits
    s = suggest(run, small)
    assert s is not None and s.plan.fits and s.plan.peak < plan.peak


def test_when_only_pipeline_parallel_fits_it_is_suggested():
    # 512k on 60 GB GPUs: every memory switch with context parallel up to x8 still does not fit
    # (the weights and optimizer state of 45 layers do not shrink with CP); splitting the layers
    # over pipeline stages does. 45 layers split into 3, 5, 9 or 15 stages, never 2 or 4.
    run = load_config("glm-5.3-flash-512k-64xb200")
    hw = Hardware(gpu_name="60 GB", gpu_bytes=60e9, gpus=64)
    switched = with_changes(run, memory={"recompute": "full", "recompute_nested": True,
                                         "offload_activations": True, "optimizer_offload": True})
    for factor in (1, 2, 4, 8):
        cp_only = estimate(with_changes(switched, parallel={"cp": factor}), Hardware(**{**hw.__dict__,
                                                                                        "gpus": 64 * factor}))
        assert not cp_only.fits
    s = suggest(run, hw)
    assert s is not None and s.plan.fits
    pp, cp = s.plan.run.parallel.pp, s.plan.run.parallel.cp
    assert pp > 1 and 45 % pp == 0 and f"pipeline parallel {pp}" in s.change
    assert s.plan.gpus == 64 * cp * pp
    # nothing with fewer GPUs fits: the suggestion is the cheapest in GPUs
    for factor in (1, 2, 4, 8):
        for stages in (1, 3, 5, 9, 15):
            if factor * stages < cp * pp:
                other = estimate(with_changes(switched, parallel={"cp": factor, "pp": stages}),
                                 Hardware(**{**hw.__dict__, "gpus": 64 * factor * stages}))
                assert not other.fits, (factor, stages)
    result = invoke("--config", "glm-5.3-flash-512k-64xb200", "--gpu-mem", "60")
    assert result.exit_code == 0, result.output
    assert f"pipeline parallel {pp}" in result.output and f"on {64 * cp * pp} GPUs" in result.output


def test_savings_are_each_switch_against_the_same_run():
    run = load_config("glm-5.3-flash-512k-64xb200")
    plan = estimate(run, Hardware())
    saved = {item.switch: item for item in plan.savings}
    off = estimate(with_changes(run, memory={"offload_activations": False}), Hardware())
    assert saved["activation offload"].gpu == off.peak - plan.peak > 0
    assert saved["activation offload"].host == off.host_per_gpu - plan.host_per_gpu < 0


def test_switches_lower_the_device_peak_and_offload_fills_host_memory():
    run = with_changes(load_config("glm-5.3-flash-4layer-1gpu"), memory={"recompute": "none",
                                                                         "offload_activations": False})
    plain = estimate(run, Hardware())
    full = estimate(with_changes(run, memory={"recompute": "full"}), Hardware())
    offload = estimate(with_changes(run, memory={"recompute": "full", "offload_activations": True}), Hardware())
    assert full.peak < plain.peak and offload.peak <= full.peak
    assert offload.host_per_gpu > full.host_per_gpu
    # pinned blocks round each layer's offloaded input up to a power of two
    assert pinned_size(3 * GiB) == 4 * GiB and pinned_size(4 * GiB) == 4 * GiB and pinned_size(0) == 0


def test_context_parallel_divides_the_activations():
    run = with_changes(load_config("glm-5.3-flash-512k-64xb200"), memory={"offload_activations": False})
    one = estimate(run, Hardware())
    two = estimate(with_changes(run, parallel={"cp": 2}), Hardware(gpus=128))
    act = [next(i.bytes for i in p.device if i.name.startswith("activations")) for p in (one, two)]
    assert 0.4 < act[1] / act[0] < 0.75  # the DSA indexer's inputs are gathered over CP, the rest halves


@pytest.mark.slow
def test_bench_sweep_writes_table_json_and_png(tmp_path):
    import json

    result = runner.invoke(app, ["bench", "sweep", "--lengths", "512,1k", "--settings", "recompute",
                                 "--threads", "1", "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [(r["setting"], r["seq_len"]) for r in rows] == [("recompute", 512), ("recompute", 1024)]
    assert all(r["peak_bytes"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_sweep_rejects_an_unknown_setting(tmp_path):
    result = runner.invoke(app, ["bench", "sweep", "--settings", "plain,fast", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "unknown fast" in result.output


def test_docs_table_matches_the_published_comparison():
    """docs/plan.md quotes the comparison; it must say what the code computes."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text()
    section = text.split("## Against the published run")[1].split("\n## ")[0]
    cells = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    ratios = [float(c[-1].strip()[1:]) for c in cells if c[-1].strip().startswith("x")]
    computed = [round(planned / fig.value, 2) for fig, planned in compare(Hardware())]
    assert ratios == computed
