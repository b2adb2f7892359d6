"""`genome-lm bench model`: a short real run against transformers, checked row by row."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.compare.bench import add_speedup, growth

pytestmark = pytest.mark.slow


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_model_cli_against_transformers(tmp_path):
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(app, ["bench", "model", "--preset", "tiny", "--seq-lens", "128,256",
                                      "--compare-transformers", "--repeats", "2", "--threads", "1",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {(r["impl"], r["T"]): r for r in data["rows"]}
    assert set(rows) == {(impl, T) for impl in ("genome-lm", "transformers") for T in (128, 256)}
    for row in rows.values():
        assert row["note"] == "measured", row
        assert row.get("indexer_loss") is None  # off by default: the same work on both sides
        assert row["threads"] == 1 and row["B"] == 1
        for key in ("seconds", "tokens_per_s", "peak_mib", "loss"):
            assert _positive(row[key]), (key, row)
        assert row["tokens_per_s"] == pytest.approx(row["T"] / row["seconds"])
        assert 1 <= row["repeats"] <= 2
    for T in (128, 256):
        ours, theirs = rows["genome-lm", T], rows["transformers", T]
        assert ours["speedup"] == pytest.approx(theirs["seconds"] / ours["seconds"])
        # the same exported weights and the same tokens: the same next-token loss
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-4)
    assert {(g["impl"], g["T_from"], g["T_to"]) for g in data["growth"]} == {
        ("genome-lm", 128, 256), ("transformers", 128, 256)}
    for g in data["growth"]:
        assert g["tokens"] == 2.0
        a, b = rows[g["impl"], 128], rows[g["impl"], 256]
        assert g["time"] == pytest.approx(b["seconds"] / a["seconds"])
        assert g["memory"] == pytest.approx(b["peak_mib"] / a["peak_mib"])
    # the table and the growth lines reach the console
    assert "torch threads: 1" in result.output
    assert "genome-lm 128 -> 256: x2.0 tokens" in result.output
    table_line = next(line for line in result.output.splitlines() if "│ 256" in line and "genome-lm" in line)
    assert f"{ours['speedup']:.3g}" in table_line


def test_bench_model_with_the_recipe_indexer_loss_and_a_batch(tmp_path):
    """The long recipe's step: a batch of sequences and the dense indexer loss in the backward."""
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(app, ["bench", "model", "--seq-lens", "128", "--batch", "2", "--indexer-loss", "dense",
                                      "--repeats", "1", "--threads", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["B"] == 2 and row["note"] == "measured"
    assert row["tokens_per_s"] == pytest.approx(2 * 128 / row["seconds"])
    assert _positive(row["indexer_loss"]) and "dense indexer loss" in row["backend"]
    assert "batch 2" in result.output


def test_bench_model_refuses_the_indexer_loss_against_transformers():
    def words(result) -> str:  # the error box wraps lines
        return " ".join(result.output.replace("│", " ").split())

    result = CliRunner().invoke(app, ["bench", "model", "--seq-lens", "128", "--indexer-loss", "dense",
                                      "--compare-transformers"])
    assert result.exit_code == 2 and "glm5_next has no indexer loss" in words(result)
    result = CliRunner().invoke(app, ["bench", "model", "--seq-lens", "128", "--indexer-loss", "sometimes"])
    assert result.exit_code == 2 and "choose off, dense or sparse" in words(result)


def test_speedup_and_growth_from_rows():
    rows = [dict(impl="genome-lm", T=1000, seconds=2.0, peak_mib=10.0),
            dict(impl="genome-lm", T=4000, seconds=10.0, peak_mib=38.0),
            dict(impl="transformers", T=1000, seconds=60.0, peak_mib=50.0),
            dict(impl="transformers", T=4000, seconds=None, peak_mib=None, note="timeout after 5 s")]
    add_speedup(rows)
    assert rows[0]["speedup"] == 30.0
    assert rows[1]["speedup"] is None  # transformers did not finish: no ratio, not a made-up one
    assert growth(rows) == [dict(impl="genome-lm", T_from=1000, T_to=4000, tokens=4.0, time=5.0, memory=3.8)]


def test_transformers_timeout_is_reported_and_longer_lengths_skipped(monkeypatch):
    from genome_lm.compare import bench as bench_mod

    calls = []

    def fake_worker(role, cfg, timeout_s):
        calls.append((role, cfg.get("T")))
        base = dict(impl=role, preset=cfg["preset"], T=cfg.get("T"), B=1, threads=cfg["threads"])
        if role == "transformers":
            return dict(base, seconds=None, peak_mib=None, note=f"timeout after {timeout_s:g} s")
        return dict(base, seconds=1.0, peak_mib=5.0, note="measured")

    monkeypatch.setattr(bench_mod, "_run_worker", fake_worker)
    rows = bench_mod.bench("tiny", (512, 256), compare_transformers=True, threads=1, timeout_s=7)
    assert calls == [("export", None), ("genome-lm", 256), ("genome-lm", 512), ("transformers", 256)]
    hf = [r for r in rows if r["impl"] == "transformers"]
    assert [r["note"] for r in hf] == ["timeout after 7 s", "skipped: timeout after 7 s at T=256"]
    assert all(r["speedup"] is None for r in rows if r["impl"] == "genome-lm")
