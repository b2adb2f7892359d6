"""`genome-lm plan`'s time output: step time, tokens/s, MFU, the split and the bottleneck, in the
table, the sweep, JSON, the plot and the published comparison."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from genome_lm.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["plan", *args], env={"COLUMNS": "200"})


def test_plan_shows_tokens_per_s_and_the_bottleneck():
    result = invoke("--config", "glm-5.3-flash-1m-64xb200")
    assert result.exit_code == 0, result.output
    for text in ("step time", "tokens/s", "per GPU", "MFU", "bottleneck", "communication", "compute", "host",
                 "expert parallel (all-to-all)", "DSA indexer selection", "MoE", "KDA"):
        assert text in result.output, text


def test_json_carries_the_time(tmp_path):
    result = invoke("--config", "glm-5.3-flash-512k-64xb200", "--json", "--gpu", "H200", "--plot",
                    str(tmp_path / "time.png"))
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    t = out["time"]
    assert t["gpu"] == "H200" and t["gpus"] == 64
    assert abs(sum(t["by_resource"].values()) - t["step_seconds"]) < 1e-6 * t["step_seconds"]
    assert abs(t["tokens_per_s"] * t["step_seconds"] - 8 * 524288) < 1e-3
    assert t["constants"]["kernel"] > 0 and out["fits"] in (True, False)
    assert (tmp_path / "time.png").stat().st_size > 10_000


def test_sweep_has_a_tokens_per_s_column_and_kernel_efficiency_moves_it():
    slow = invoke("--config", "glm-5.3-flash-512k-64xb200", "--sweep")
    fast = invoke("--config", "glm-5.3-flash-512k-64xb200", "--sweep", "--kernel-efficiency", "0.5")
    assert slow.exit_code == 0 and fast.exit_code == 0, slow.output + fast.output
    assert "predicted step time over sequence lengths" in slow.output and "bound by" in slow.output

    def tokens_at_1m(output):
        table = output.split("predicted step time")[1]
        row = next(line for line in table.splitlines() if line.strip("│ ").startswith("1M"))
        cells = [c.strip() for c in row.split("│") if c.strip()]
        return float(cells[2].replace(",", ""))

    assert tokens_at_1m(fast.output) > tokens_at_1m(slow.output)


def test_published_shows_the_time_figures():
    result = invoke("--published")
    assert result.exit_code == 0, result.output
    for text in ("13,700 tokens/s", "24,900 tokens/s", "+21%", "fitted (kernel efficiency)", "predicted"):
        assert text in result.output, text


def test_bad_kernel_efficiency_and_plot_on_cpu():
    result = invoke("--config", "glm-5.3-flash-1m-64xb200", "--kernel-efficiency", "1.5")
    assert result.exit_code != 0 and "--kernel-efficiency 1.5" in result.output
    result = invoke("--config", "demo-cpu", "--device", "cpu", "--plot", "x.png")
    assert result.exit_code != 0 and "--plot" in result.output


def test_plot_into_a_missing_folder_is_one_line_and_writes_nothing(tmp_path):
    target = tmp_path / "missing" / "time.png"
    result = invoke("--config", "glm-5.3-flash-1m-64xb200", "--plot", str(target))
    assert result.exit_code != 0 and "no folder" in result.output and "Traceback" not in result.output
    assert not target.parent.exists()
    invoke("--config", "glm-5.3-flash-1m-64xb200", "--plot", str(tmp_path / "time.png"))
    assert [p.name for p in tmp_path.iterdir()] == ["time.png"]  # no temporary file left beside it


def test_gpu_mem_with_an_unknown_gpu_plans_memory_alone():
    result = invoke("--config", "demo-cpu", "--gpu", "A100", "--gpu-mem", "40")
    assert result.exit_code == 0, result.output
    assert "on a 40 GB" in result.output and "Step time" not in result.output
    result = invoke("--config", "demo-cpu", "--gpu", "A100")
    assert result.exit_code != 0 and "--gpu A100: unknown GPU" in result.output
