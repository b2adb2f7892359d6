"""The copy probe measures recall: an oracle that copies shows a large advantage, a model
without memory none; recall-bench's own sweep agrees through its CallableModel interface."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from genome_lm.data.tokenizer import A, T
from genome_lm.eval.recall import SequencePool, copy_probe, default_distances, probe_sequences, run_recall_bench

K = 12


class CopyOracle(torch.nn.Module):
    """Next base = the base that followed the last earlier occurrence of the current 12-mer
    (probability 0.97), else uniform over A, C, G, T: perfect long-range recall, nothing else."""

    def forward(self, ids_BT):
        ids = ids_BT[0].tolist()
        logits = torch.full((1, len(ids), 16), -30.0)
        logits[0, :, A:T + 1] = 0.0
        seen = {}
        for t in range(len(ids)):
            if t + 1 >= K:
                key = tuple(ids[t + 1 - K:t + 1])
                if key in seen:
                    logits[0, t, A:T + 1] = -30.0
                    logits[0, t, seen[key]] = 0.0
                    logits[0, t, [b for b in range(A, T + 1) if b != seen[key]]] = np.log(0.01)
                if t + 1 < len(ids):
                    seen[key] = ids[t + 1]
        return SimpleNamespace(logits=logits)


class NoMemory(torch.nn.Module):
    def forward(self, ids_BT):
        return SimpleNamespace(logits=torch.zeros(1, ids_BT.shape[1], 16))


@pytest.fixture(scope="module")
def pool():
    return SequencePool.random(200_000, seed=1)


def test_probe_sequences_differ_only_in_the_first_piece(pool):
    rng = np.random.default_rng(0)
    repeat, control, first = probe_sequences(pool, rng, 300, 50, 20)
    assert repeat.size == control.size == 20 + 50 + 300 + 50 and first == 370
    np.testing.assert_array_equal(repeat[first:], repeat[20:70])  # the copy
    differ = np.flatnonzero(repeat != control)
    assert differ.min() >= 20 and differ.max() < 70


def test_copy_advantage_of_an_oracle_and_of_a_model_without_memory(pool):
    rows = copy_probe(CopyOracle(), pool, [64, 1024], segment=64, trials=5, seed=0)
    for r in rows:
        # control: uniform (ln 4 = 1.386); repeat: 12 uniform bases then 0.97 on the copy
        assert r.ce_control == pytest.approx(np.log(4), abs=0.05)
        assert r.ce_repeat < 0.45 and r.ci_low > 0.9 and r.ci_low <= r.advantage <= r.ci_high
    flat = copy_probe(NoMemory(), pool, [64], segment=64, trials=3)[0]
    assert flat.advantage == 0 and flat.ci_low == flat.ci_high == 0
    again = copy_probe(CopyOracle(), pool, [64, 1024], segment=64, trials=5, seed=0)
    assert again == rows  # seeded


def test_recall_bench_through_its_callable_model(pool):
    pytest.importorskip("recall_bench")
    rows = run_recall_bench(CopyOracle(), pool, [64], trials=4, segment=64)
    assert rows[0]["status"] == "ok" and rows[0]["copy_advantage"] > 0.9, rows
    rows = run_recall_bench(NoMemory(), pool, [64], trials=2, segment=64)
    assert rows[0]["copy_advantage"] == pytest.approx(0, abs=1e-9)


def test_default_distances():
    assert default_distances(16384) == [64, 256, 1024, 4096, 16384]
    assert default_distances(1000) == [64, 256]


def test_recall_command_writes_its_rows(tmp_path):
    import json

    from typer.testing import CliRunner

    from genome_lm.cli import app

    out = tmp_path / "recall.json"
    result = CliRunner().invoke(app, ["recall", "--model", "preset:tiny", "--distances", "64,200", "--trials", "2", "--no-recall-bench",
                                      "--segment", "32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["schema"] == "genome-lm.recall/1" and doc["source"] == "random"
    assert [r["distance"] for r in doc["rows"]] == [64, 200]
    assert all(r["ci_low"] <= r["advantage"] <= r["ci_high"] for r in doc["rows"])
    assert "copy advantage" in result.output
