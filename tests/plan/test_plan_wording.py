"""How `genome-lm plan` words what it shows (issue 53, item 6): each memory switch's effect on the
GPU and on the host with signs that read right, and the published run's setting named apart from
the shipped config wherever both appear."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.config import load_config
from genome_lm.plan.memory_model import GiB, Hardware, estimate
from genome_lm.plan.report import budget_table

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["plan", *args], env={"COLUMNS": "400"})


def _rows(table) -> dict[str, list[str]]:
    """A rich table's rows by their first cell (plain strings)."""
    columns = [[str(cell) for cell in column.cells] for column in table.columns]
    return {row[0]: list(row[1:]) for row in zip(*columns)}


def test_each_switch_says_what_it_saves_on_the_gpu_and_on_the_host():
    """Under activation offload full recompute saves host memory, not GPU memory: its row used
    to read "saved by recompute full 0.00 | host +5,648.00 GiB per GPU", a saving of nothing and
    a host figure that looked like a cost. Every row now says what the switch saves or costs on
    each side, against the same run without it."""
    plan = estimate(load_config("glm-5.3-flash-1m-64xb200"), Hardware())
    by = {s.switch: s for s in plan.savings}
    recompute, offload, optimizer = by["recompute full"], by["activation offload"], by["optimizer offload"]
    assert abs(recompute.gpu) < 0.005 * GiB and recompute.host > 1000 * GiB
    assert offload.gpu > 0 > offload.host and optimizer.gpu > 0 > optimizer.host
    rows = _rows(budget_table(plan))
    assert not any(name.startswith("saved by") for name in rows)
    assert rows["recompute full (vs none)"] == ["0.00", "GPU peak: unchanged; host: saves 5,648.00 GiB per GPU"]
    assert rows["activation offload (vs off)"] == ["107.90", "GPU peak: saves 107.90 GiB; host: costs 112.00 GiB "
                                                   "per GPU"]
    assert rows["optimizer offload (vs off)"][1] == "GPU peak: saves 55.08 GiB; host: costs 73.43 GiB per GPU"
    # the chunks are compared with the MoE whole, their recompute included
    assert rows["MoE in 64 chunks, each recomputed (vs whole)"][1] == "GPU peak: saves 116.27 GiB; host: unchanged"
    assert rows["each MoE chunk recomputed (vs the 64 chunks kept)"][1].startswith("GPU peak: saves 88.27 GiB")
    assert rows["DSA query chunk 1024 (vs 64)"][1] == "GPU peak: unchanged; host: unchanged"


def test_a_cost_reads_as_a_cost():
    from genome_lm.plan.report import effect

    assert effect(-2 * GiB) == "costs 2.00 GiB" and effect(3 * GiB) == "saves 3.00 GiB"
    assert effect(0.001 * GiB) == effect(-0.001 * GiB) == "unchanged"  # below what the table shows
    # the published recipe's 64k query blocks cost GPU memory: the indexer's blocks make the peak
    run = load_config("glm-5.3-flash-512k-64xb200", ["memory.dsa_query_chunk=65536"])
    plan = estimate(run, Hardware())
    chunk = next(s for s in plan.savings if s.switch == "DSA query chunk 65536")
    assert chunk.gpu < -GiB and "indexer blocks" in plan.peak_where
    assert _rows(budget_table(plan))["DSA query chunk 65536 (vs 64)"] == [
        f"{chunk.gpu / GiB:,.2f}", f"GPU peak: costs {-chunk.gpu / GiB:,.2f} GiB; host: unchanged"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One search of the 1M config on its stated 64 GPUs (no --gpus), with --write."""
    out = tmp_path_factory.mktemp("search") / "best.yaml"
    result = invoke("--config", "glm-5.3-flash-1m-64xb200", "--search", "--top", "3", "--write", str(out))
    assert result.exit_code == 0, result.output
    return result.output, out.read_text()


def test_the_search_names_the_published_setting_and_the_shipped_config_apart(searched):
    """The search's "published" row is the published run's setting (the DSA selection on every
    rank), 13,717 tokens/s; the shipped config of that name splits the selection and predicts
    18,749 (plain `plan`). Both are named and given, in the table and its closing lines."""
    output, _ = searched
    table, closing = output.split("candidates fit")
    assert "[the published run's setting]" in table and "[the shipped config]" in table
    assert "vs published run's setting" in table and "[published]" not in table
    assert ("the published run's setting (glm-5.3-flash-1m-64xb200 with DSA selection on every rank, MoE "
            "chunks not recomputed): 13,717 tokens/s") in closing
    assert "the shipped config glm-5.3-flash-1m-64xb200: 18,749 tokens/s" in closing
    assert "The best against the published run's setting" in closing


def test_the_written_note_names_both(searched):
    _, text = searched
    note = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert ("13,717 for the published run's setting (glm-5.3-flash-1m-64xb200 with DSA selection on every rank, "
            "MoE chunks not recomputed) and") in note
    assert "18,749 for the shipped config glm-5.3-flash-1m-64xb200." in note


def test_the_plain_plan_says_the_published_run_ran_another_setting():
    result = invoke("--config", "glm-5.3-flash-1m-64xb200")
    assert result.exit_code == 0, result.output
    time_part = result.output.split("Step time of")[1]
    assert time_part.startswith(" the shipped config glm-5.3-flash-1m-64xb200 on 64 x B200")
    assert "18,749" in time_part
    row = next(line for line in time_part.splitlines() if "published run's setting" in line)
    assert "13,717" in row and "DSA selection on every rank" in row and "plan --published" in row
    # a config the published run did not run says nothing of it
    other = invoke("--config", "glm-5.3-flash-1m-64xb200-searched")
    assert other.exit_code == 0 and "published run" not in other.output


def test_published_tables_name_the_setting_and_give_the_shipped_config():
    result = invoke("--published")
    assert result.exit_code == 0, result.output
    memory, time = result.output.split("published throughput")
    assert "shipped config (changes)" in memory  # the memory rows plan the configs as shipped
    assert "the published run's setting (changes)" in time and "the shipped config" in time
    row = next(line for line in time.splitlines() if "tokens/s at 1M" in line)
    assert "13,717 tokens/s" in row and "18,749 tokens/s" in row
