"""The report's figures read in the tables' unit, nats per base, with the tables' numbers."""

import json
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from genome_lm.eval.planted import distance_figure
from genome_lm.eval.report import loss_figure
from genome_lm.eval.schema import EvalReport

matplotlib.use("Agg")

REPORT = EvalReport.from_json(json.loads((Path(__file__).parent / "data" / "demo_eval.json").read_text()))


def test_the_loss_figure_plots_the_tables_nats():
    fig = loss_figure(REPORT)
    ax = fig.axes[0]
    assert "nats per base" in ax.get_ylabel()
    lines = [line for line in ax.get_lines() if len(line.get_ydata()) > 1]
    expected = {name: [b.nats for b in entry.buckets if b.tokens] for name, entry in REPORT.results.items()}
    plotted = [list(line.get_ydata()) for line in lines]
    for values in expected.values():
        assert any(np.allclose(values, p) for p in plotted), (values, plotted)


def test_the_planted_copies_figure_plots_nats():
    fig = distance_figure(REPORT.planted)
    ax = fig.axes[0]
    assert "nats per base" in ax.get_ylabel()
    rows = REPORT.planted.models["model"].by_distance
    values = [r.in_context_nats for r in rows if r.in_context_nats is not None]
    assert any(np.allclose(values, line.get_ydata()) for line in ax.get_lines() if len(line.get_ydata()) == len(values))
    background = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert background[0].get_ydata()[0] == pytest.approx(REPORT.planted.models["model"].background_nats)
