"""``genome-lm bench sweep``'s time columns: the step's FLOPs at this CPU's matmul rate beside
the measured step."""

from __future__ import annotations

import pytest

from genome_lm.config import load_config
from genome_lm.model import flops
from genome_lm.plan.memory_model import model_config, with_changes
from genome_lm.plan.sweep import SETTINGS, run_sweep, step_flops, sweep_rows_table


def test_step_flops_counts_recompute():
    run = with_changes(load_config("demo-cpu"), data={"seq_len": 2048})
    plain, full = step_flops(run), step_flops(with_changes(run, memory=SETTINGS["recompute"]))
    work = flops.step_work(model_config(run), run.memory, T=2048, indexer_loss_mode=run.train.indexer_loss)
    assert plain == pytest.approx(flops.total(work))
    assert plain < full < 1.6 * plain


@pytest.mark.slow
def test_sweep_rows_carry_predicted_time(tmp_path):
    rows = run_sweep(["plain"], [1024], threads=1, out=tmp_path)
    (row,) = rows
    assert row["flops"] > 0 and row["matmul_flops_per_s"] > 1e8
    assert row["predicted_seconds"] == pytest.approx(row["flops"] / row["matmul_flops_per_s"])
    # no CPU step beats its FLOPs at the matmul rate
    assert row["seconds"] > row["predicted_seconds"]
    assert sweep_rows_table(rows).row_count == 1
