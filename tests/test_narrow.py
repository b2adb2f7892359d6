"""Output at 80 columns (a narrow terminal, or any pipe: rich renders at 80 there): no table cell
is cut to "…", a table too wide is split into parts that repeat its first column, and a line of
text (a command to copy) prints on one line (``genome_lm.cli.narrow``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.table import Table
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.cli.base import make_console
from tests.conftest import random_sequence, write_fasta

runner = CliRunner()
DEMO_EVAL = Path(__file__).parent / "eval" / "data" / "demo_eval.json"  # a real demo's eval.json
MLFLOW = ("MLflow: mlflow ui --backend-store-uri sqlite:////tmp/x/run/mlflow.db (experiment 1, run "
          "29ea4c5f0b9e4f0e8f1a2b3c4d5e6f70)")
BOX = "┏┃┡│└├"  # the first character of a table's lines (rich's default box)


def _console():
    return make_console(width=80, file=io.StringIO())


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in BOX]


def test_parity_table_keeps_every_value_whole(monkeypatch, tmp_path):
    """parity's 11 columns at 80: every figure whole (they were all "…"), split into parts that
    each repeat T; its progress lines print whole."""
    from genome_lm.cli import check
    from genome_lm.compare import parity
    from genome_lm.compare.parity import ParityRow

    rows = [ParityRow(length=1, max_abs_logit=3.81e-06, mean_abs_logit=1.12e-06, max_abs_logprob=2.86e-06,
                      passed=True),
            ParityRow(length=4096, max_abs_logit=4.58e-05, mean_abs_logit=6.31e-06, max_abs_logprob=3.43e-05,
                      passed=True, tied_queries=1234, first_tie=1027, max_abs_logit_after=0.0213),
            ParityRow(length=65536, max_abs_logit=0.000217, mean_abs_logit=1.94e-05, max_abs_logprob=0.000198,
                      passed=False, tied_queries=20481, first_tie=3073, max_abs_logit_after=0.0417,
                      routing_flips=12, selection_flips=3, first_flip=40961)]

    def run_parity(hf, lengths, *, tol, progress, **kw):
        for row in rows:
            progress(row)
        return rows

    out = _console()
    monkeypatch.setattr(check, "console", out)
    monkeypatch.setattr(parity, "run_parity", run_parity)
    result = runner.invoke(app, ["parity", "--hf", str(tmp_path), "--backend", "torch"])
    assert result.exit_code == 1  # the last row fails its bound
    text = out.file.getvalue()
    assert "…" not in text
    values = ["3.81e-06", "1.12e-06", "2.86e-06", "4.58e-05", "6.31e-06", "3.43e-05", "1,234", "1,027", "0.0213",
              "0.000217", "1.94e-05", "0.000198", "20,481", "3,073", "0.0417", "12", "40,961", "NO", "65,536"]
    cells = {cell.strip() for line in _table_lines(text) for cell in line[1:-1].split("│")}
    assert set(values) <= cells, set(values) - cells
    assert all(len(line) <= 80 for line in _table_lines(text))
    parts = text.count("┏")
    assert parts > 1 and text.count("(continued)") == parts - 1
    for length in ("1", "4,096", "65,536"):  # T, the first column, in every part
        assert sum(line.split("│")[1].strip() == length for line in _table_lines(text) if line[0] == "│") == parts
    progress = ("T=65,536: max |d logit| 0.000217, max |d logprob| 0.000198 (before the first top-k tie at "
                "position 3,073; 20,481 tied queries and the first flip at position 40,961; 12 routing and 3 "
                "selection flips)")
    assert progress in text.splitlines()


def test_eval_report_keeps_bucket_labels_whole():
    """eval's report at 80 columns (a model, its baseline, uniform and Markov): the buckets read
    1,024-2,047, not 1,024-2,…; the MLflow command is one line."""
    from genome_lm.cli.eval import print_report
    from genome_lm.eval.schema import EvalReport

    report = EvalReport.from_json(json.loads(DEMO_EVAL.read_text()))
    out = _console()
    print_report(report, out)
    text = out.file.getvalue()
    assert "…" not in text
    labels = [line.split("│")[1].strip() for line in _table_lines(text) if line.startswith("│")]
    for bucket in report.results["model"].buckets:
        assert f"{bucket.start:,}-{bucket.end - 1:,}" in labels
    assert {"all", "unmasked", "softmasked"} <= set(labels)
    assert all(len(line) <= 80 for line in _table_lines(text))
    assert f"MLflow: {report.mlflow.location}" in text.splitlines()


def test_a_long_line_prints_on_one_line_and_a_table_title_still_wraps():
    """A command printed for the reader to copy stays on one line (the terminal folds it, a pipe
    keeps it whole); a table on the same console still fits 80 columns, its long title too."""
    out = _console()
    out.print(MLFLOW, highlight=False)
    table = Table(title="a title of many words " * 8)
    table.add_column("a")
    table.add_row("b")
    out.print(table)
    lines = out.file.getvalue().splitlines()
    assert lines[0] == MLFLOW
    assert all(len(line.rstrip()) <= 80 for line in lines[1:]) and len(lines) > 6


def _words(row: int, column: int) -> str:
    return f"r{row:02d}c{column:02d}word"  # 10 characters


def test_a_wide_table_splits_into_parts_that_repeat_its_label_column():
    """12 columns of 10-character words at 80 columns: parts of at most 80 characters, each
    starting with the label column, every cell in one of them, whole; the caption once, last."""
    table = Table(title="twelve columns", caption="caption: settings")
    for column in range(12):
        table.add_column(f"head{column:02d}xxxx")
    for row in range(3):
        table.add_row(*(_words(row, column) for column in range(12)))
    out = _console()
    out.print(table)
    text = out.file.getvalue()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in text
    parts = text.count("┏")
    assert parts == 3 and text.count("twelve columns (continued)") == 2
    assert text.count("caption: settings") == 1 and "caption" in lines[-1]
    for row in range(3):
        assert text.count(_words(row, 0)) == parts
        for column in range(1, 12):
            assert text.count(_words(row, column)) == 1
    assert [line.count("┳") for line in lines if line.startswith("┏")] == [4, 4, 3]  # shared out evenly


def test_a_column_its_author_keeps_on_one_line_stays_on_one_line():
    """A no_wrap column keeps its cells on one line when the table is split around it."""
    table = Table(title="with a no_wrap column")
    table.add_column("label")
    table.add_column("path", no_wrap=True)
    for column in range(8):
        table.add_column(f"column {column}")
    table.add_row("first", "runs/glm-5.3-flash-512k checkpoint 12", *(f"{column:,} bases" for column in
                                                                        range(1000, 9000, 1000)))
    out = _console()
    out.print(table)
    text = out.file.getvalue()
    assert "runs/glm-5.3-flash-512k checkpoint 12" in text and "…" not in text
    assert all(f"{column:,}" in text for column in range(1000, 9000, 1000))


def test_a_word_wider_than_the_console_folds_and_the_other_columns_keep_theirs():
    """A path of 120 characters cannot fit 80 columns: it folds onto the next lines (every
    character kept) while the columns beside it keep their widest word."""
    path = "/runs/" + "x" * 110 + "/ckpt"
    table = Table(title="checkpoints")
    for column in ("path", "step", "note"):
        table.add_column(column)
    table.add_row(path, "1,048,576", "resumed from an earlier run")
    out = _console()
    out.print(table)
    text = out.file.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    folded = [line.split("│")[1].strip() for line in _table_lines(text) if line.startswith("│")]
    assert "".join(folded).startswith(path) and "1,048,576" in text and "earlier" in text


@pytest.mark.parametrize("args", [
    ["plan", "--config", "glm-5.3-flash-1m-64xb200", "--sweep"],
    ["plan", "--published"],
    ["plan", "--config", "glm-5.3-flash-1m-64xb200", "--search", "--gpus", "64", "--top", "3"],
], ids=["sweep", "published", "search"])
def test_commands_at_80_columns_cut_no_word(args):
    """The planner's tables through typer's runner at COLUMNS=80 (the shared console writes to
    the runner's stdout and takes its width from COLUMNS when it prints)."""
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert _table_lines(result.output) and all(len(line) <= 80 for line in _table_lines(result.output))


def test_prepare_at_80_columns_keeps_long_record_names_whole(tmp_path):
    """prepare's summary with hg38's unplaced scaffolds in its splits: their names whole (they
    were "chr1_KI270706v1_…")."""
    rng = np.random.default_rng(0)
    names = ["chr1", "chr1_KI270706v1_random", "chr22", "chr22_KI270731v1_random"]
    fasta = write_fasta(tmp_path / "genome.fa", {name: random_sequence(rng, 3000) for name in names})
    result = runner.invoke(app, ["prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"), "--window", "1k",
                                 "--train-chroms", ",".join(names[:2]), "--eval-chroms", ",".join(names[2:]),
                                 "--quiet", "--workers", "1"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and all(name in result.output for name in names)
    assert all(len(line) <= 80 for line in _table_lines(result.output))
