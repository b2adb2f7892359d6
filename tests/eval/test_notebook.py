"""The analysis notebook runs on a demo evaluation's output (so it never goes stale)."""

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO


@pytest.mark.slow
def test_analysis_notebook_executes_on_the_demo_output(evaluated, monkeypatch, tmp_path):
    out, report, _ = evaluated
    monkeypatch.setenv("GENOME_LM_EVAL_JSON", str(out / "eval.json"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows the figure
    nb = nbformat.read(REPO / "notebooks" / "eval_analysis.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"{report['data']['tokens']:,} scored bases" in text
    assert f"child of training run {report['mlflow']['run_id']}" not in text  # the parent is the training run
    assert "child of training run" in text and "eval.json" in text
    assert "planted copies" in text
    figures = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(figures) == 1
    tables = [o for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})]
    assert tables and "change_vs_baseline" in tables[0]["data"]["text/html"]
