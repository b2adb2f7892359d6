"""The copy probe measures recall: an oracle that copies shows a large advantage, a model
without memory none; recall-bench's own sweep agrees through its CallableModel interface. The
default sweep ends at the model's window; probe pieces come from a prepared dataset's N-free
stretches."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pyfaidx
import pytest
import torch
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.data.tokenizer import A, T
from genome_lm.errors import GenomeLMError
from genome_lm.eval.probes import recall
from genome_lm.eval.probes.recall import (
    SequencePool,
    copy_probe,
    default_distances,
    largest_distance,
    probe_sequences,
    probe_window,
    run_recall_bench,
    window_distances,
)
from tests.conftest import write_fasta

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
    out = tmp_path / "recall.json"
    result = CliRunner().invoke(app, ["recall", "--model", "preset:tiny", "--distances", "64,200", "--trials", "2",
                                      "--no-recall-bench",
                                      "--segment", "32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["schema"] == "genome-lm.recall/1" and doc["source"] == "random"
    assert [r["distance"] for r in doc["rows"]] == [64, 200]
    assert all(r["ci_low"] <= r["advantage"] <= r["ci_high"] for r in doc["rows"])
    assert "copy advantage" in result.output


class Clocked(NoMemory):
    """NoMemory on a fake clock: each forward takes 1 ms per token."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def forward(self, ids_BT):
        self.clock[0] += 1e-3 * ids_BT.shape[1]
        return super().forward(ids_BT)


def test_copy_probe_stops_before_a_distance_predicted_to_end_past_the_budget(pool, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(recall.time, "perf_counter", lambda: clock[0])
    seg, trials = 32, 2
    seconds = {d: trials * 2 * 1e-3 * (recall.LEAD + 2 * seg + d) for d in (64, 256, 1024, 4096)}
    budget = seconds[64] + seconds[256] + 0.5 * seconds[1024]  # 1024 would end past it
    seen = []
    rows = copy_probe(Clocked(clock), pool, [64, 256, 1024, 4096], segment=seg, trials=trials, budget_s=budget,
                      on_row=seen.append)
    assert [r.distance for r in rows] == [64, 256] and seen == rows
    clock[0] = 0.0
    budget = seconds[64] + seconds[256] + seconds[1024] + 1e-9
    assert [r.distance for r in copy_probe(Clocked(clock), pool, [64, 256, 1024], segment=seg, trials=trials,
                                           budget_s=budget)] == [64, 256, 1024]
    clock[0] = 0.0  # the first distance always runs, whatever the budget
    assert [r.distance for r in copy_probe(Clocked(clock), pool, [64, 256], segment=seg, trials=trials,
                                           budget_s=1e-9)] == [64]


def test_recall_command_over_its_budget_keeps_what_finished_and_names_the_rest(tmp_path):
    out = tmp_path / "recall.json"
    result = CliRunner().invoke(app, ["recall", "--model", "preset:tiny", "--distances", "64,200,300", "--trials", "2",
                                      "--no-recall-bench", "--segment", "32", "--max-seconds", "0.001",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [r["distance"] for r in doc["rows"]] == [64]
    assert doc["skipped_for_time"] == [200, 300] and doc["complete"] is False
    assert doc["distances_planned"] == [64, 200, 300]
    assert "time budget 0.001 s reached: distances 200, 300 not run" in result.output
    assert "d=64: copy advantage" in result.output and "updated" in result.output


def test_recall_prints_small_advantages_with_their_digits(tmp_path, monkeypatch):
    """A 3.6e-5 advantage is printed as such, not as +0.0000."""
    def tiny_advantage(model, pool, distances, **kw):
        rows = [recall.RecallRow(d, 2, 1.38620, 1.38623, 3.6e-5, 1.1e-5, 6.2e-5) for d in distances]
        for r in rows:
            kw["on_row"](r)
        return rows

    monkeypatch.setattr(recall, "copy_probe", tiny_advantage)
    result = CliRunner().invoke(app, ["recall", "--model", "preset:tiny", "--distances", "64", "--trials", "2",
                                      "--no-recall-bench", "--segment", "32", "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "+3.60e-05" in result.output and "+0.0000" not in result.output


# --------------------------------------------------------------------------- a small prepared dataset

WINDOW = 512  # chr22 (eval): 3 windows of 512 bases; chr1 (train): 2 windows
ACGT = {"A": 4, "C": 5, "G": 6, "T": 7}  # token ids, from the vocabulary table of the docs


def _chr22(rng) -> bytes:
    """Random mixed-case bases with ambiguous bases at chosen places (N, an IUPAC R, a lowercase n):
    window 0: N-free runs [0,100) and [101,200) and [201,512); window 1: [512,700) and [701,1024);
    window 2: runs of 89 bases and a last one of 61 (an N every 90 bases)."""
    seq = bytearray(rng.choice(np.frombuffer(b"ACGTacgt", np.uint8), size=3 * WINDOW).tobytes())
    seq[100], seq[200], seq[700] = ord("N"), ord("R"), ord("n")
    for k in range(6):
        seq[2 * WINDOW + 90 * k] = ord("N")
    return bytes(seq)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """(dataset folder, FASTA) prepared with `prepare`: chr1 train, chr22 eval, 512-base windows."""
    from genome_lm.data.prepare import PrepareRequest, prepare
    from genome_lm.data.windows import WindowSpec

    root = tmp_path_factory.mktemp("recall-data")
    rng = np.random.default_rng(22)
    records = {"chr1": rng.choice(np.frombuffer(b"ACGT", np.uint8), size=2 * WINDOW).tobytes(), "chr22": _chr22(rng)}
    fasta = write_fasta(root / "genome.fa", records, width=70)
    prepare(PrepareRequest(fasta, root / "dataset", ("chr1",), ("chr22",), WindowSpec(WINDOW, WINDOW, "keep", 64, 0.5)),
            workers=1, quiet=True, cache_dir=root / "cache")
    return root / "dataset", fasta


def _chrom_text(fasta, name: str) -> str:
    """A record of the FASTA as written, read with pyfaidx (independent of genome-lm's reader)."""
    return str(pyfaidx.Fasta(str(fasta), as_raw=True, sequence_always_upper=False)[name][:])


def _expected_stretches(fasta, min_run: int) -> list[tuple[int, int]]:
    """(start, end) on chr22 of every run of A/C/G/T (any case) of at least min_run bases inside one
    512-base window."""
    text = _chrom_text(fasta, "chr22")
    spans = []
    for start in range(0, len(text), WINDOW):
        piece = text[start:start + WINDOW]
        spans += [(start + m.start(), start + m.end()) for m in re.finditer("[ACGTacgt]+", piece)
                  if m.end() - m.start() >= min_run]
    return spans


@pytest.mark.parametrize("min_run", [100, 101, 200, 312, 323])
def test_sequence_pool_from_dataset_is_the_n_free_stretches_of_the_eval_split(dataset, min_run):
    from genome_lm.data.manifest import Manifest

    folder, fasta = dataset
    windows = Manifest.load(folder).split("eval").windows
    assert [(w.chrom, w.start, w.end) for w in windows] == [("chr22", 0, 512), ("chr22", 512, 1024),
                                                            ("chr22", 1024, 1536)]
    spans = _expected_stretches(fasta, min_run)
    hand = [(0, 100), (201, 512), (512, 700), (701, 1024)]  # see _chr22; [101, 200) is 99 bases
    assert spans == [(a, b) for a, b in hand if b - a >= min_run]
    pool = SequencePool.from_dataset(folder, min_run=min_run)
    text = _chrom_text(fasta, "chr22").upper()
    assert [s.tolist() for s in pool.stretches] == [[ACGT[c] for c in text[a:b]] for a, b in spans]
    assert pool.lengths.tolist() == [b - a for a, b in spans]


def test_sequence_pool_from_dataset_reads_the_split_it_is_given(dataset):
    folder, fasta = dataset
    train = SequencePool.from_dataset(folder, "train", min_run=100)
    chr1 = _chrom_text(fasta, "chr1")
    assert [s.tolist() for s in train.stretches] == [[ACGT[c] for c in chr1[a:a + WINDOW]] for a in (0, WINDOW)]


def test_sequence_pool_from_dataset_errors_name_the_dataset(dataset, tmp_path):
    folder, _ = dataset
    with pytest.raises(GenomeLMError) as info:
        SequencePool.from_dataset(folder, min_run=324)  # the longest N-free run is 323 bases
    text = str(info.value)
    assert str(folder) in text and "'eval'" in text and "no N-free stretch of at least 324 bases" in text
    assert "longest stretch 323 bases" in text and "3 windows" in text
    with pytest.raises(GenomeLMError, match="no split 'validation'"):
        SequencePool.from_dataset(folder, "validation")
    with pytest.raises(GenomeLMError, match="not a prepared dataset"):
        SequencePool.from_dataset(tmp_path / "nothing-here")


# --------------------------------------------------------------------------- the default sweep


def test_window_distances_end_at_the_largest_probe_that_fits():
    assert window_distances(1024, 32) == [64, 256, 896]  # 1024 - 64 lead - 2 x 32
    assert window_distances(64 + 2 * 32 + 256, 32) == [64, 256]  # the largest fitting d is a power of 4
    assert window_distances(64 + 2 * 32 + 257, 32) == [64, 256, 257]
    assert window_distances(64 + 2 * 8 + 40, 8) == [40]  # shorter than 64: the one distance that fits
    full = window_distances(512 * 1024, 256)
    assert full == [64, 256, 1024, 4096, 16384, 65536, 262144, 524288 - 64 - 512]
    assert recall.LEAD + 2 * 256 + full[-1] == 512 * 1024
    for window, segment in ((1024, 32), (4096, 256), (100_000, 256)):
        assert recall.LEAD + 2 * segment + largest_distance(window, segment) == window
    with pytest.raises(ValueError, match="leaves no room"):
        window_distances(64 + 2 * 256, 256)
    assert recall.FALLBACK_MAX_DISTANCE == 4096


def test_probe_window_prefers_the_run_config_then_the_dataset(dataset):
    from genome_lm.config import DataConfig, RunConfig

    folder, _ = dataset
    run = RunConfig(data=DataConfig(dataset=str(folder), seq_len=256))
    assert probe_window(run, folder) == (256, "the run's data.seq_len")
    warm = RunConfig(data=DataConfig(seq_len=4096, seq_len_warmup=[(30, 65536), (10, 16384)]))
    assert probe_window(warm, folder) == (65536, "the run's data.seq_len_warmup")
    assert probe_window(None, folder) == (WINDOW, f"the window length of dataset {folder}")
    assert probe_window(None, None)[0] is None
    with pytest.raises(GenomeLMError, match="not a prepared dataset"):
        probe_window(None, folder.parent / "missing")


def _recall(*args):
    return CliRunner().invoke(app, ["recall", "--model", "preset:tiny", "--trials", "2", "--segment", "32", *args])


def test_recall_command_sweeps_up_to_the_dataset_window(dataset, tmp_path):
    folder, _ = dataset
    out = tmp_path / "recall.json"
    result = _recall("--dataset", str(folder), "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [r["distance"] for r in doc["rows"]] == [64, 256, 384]  # 512 - 64 - 2 x 32
    assert doc["window"] == WINDOW and str(folder) in doc["window_from"] and doc["source"] == str(folder)
    assert doc["lead"] + 2 * doc["segment"] + doc["rows"][-1]["distance"] == WINDOW
    assert "fits the model's 512-base window" in result.output and "64, 256, 384" in result.output
    if doc["recall_bench"] is not None:
        # recall-bench rounds its probe up to a power of two (1,024 here): above the window, skipped
        assert all(r["status"].startswith("skip") for r in doc["recall_bench"]), doc["recall_bench"]


def test_recall_command_takes_the_window_from_the_run_config(dataset, tmp_path, monkeypatch):
    """A training run's longest seq_len wins over its dataset's window; --max-distance over both."""
    import dataclasses

    from genome_lm.config import DataConfig, RunConfig
    from genome_lm.eval import models

    folder, _ = dataset
    real = models.load_model
    run = RunConfig(data=DataConfig(dataset=str(folder), seq_len=256))

    def as_a_run(spec, pg, **kw):  # the tiny preset, as if it were a run trained on 256-base crops of the dataset
        return dataclasses.replace(real(spec, pg, **kw), config=run)

    monkeypatch.setattr(models, "load_model", as_a_run)
    out = tmp_path / "recall.json"
    result = _recall("--no-recall-bench", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [r["distance"] for r in doc["rows"]] == [64, 128]  # 256 - 64 - 2 x 32, not the dataset's 384
    assert doc["window"] == 256 and doc["window_from"] == "the run's data.seq_len" and doc["source"] == str(folder)

    result = _recall("--no-recall-bench", "--max-distance", "600", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert [r["distance"] for r in json.loads(out.read_text())["rows"]] == [64, 256, 600]  # ends at the cap
    assert "up to --max-distance 600" in result.output
    assert "longest probe (728 bases) exceeds the model's 256-base window" in result.output


def test_recall_command_falls_back_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(recall, "FALLBACK_MAX_DISTANCE", 256)  # 4k: too slow for a test on a CPU
    out = tmp_path / "recall.json"
    result = _recall("--no-recall-bench", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [r["distance"] for r in doc["rows"]] == [64, 256] and doc["window"] is None and doc["source"] == "random"
    assert "window length unknown" in result.output and "--max-distance" in result.output


def test_recall_command_names_a_dataset_without_long_enough_stretches(dataset, tmp_path):
    folder, _ = dataset
    out = tmp_path / "recall.json"
    result = CliRunner().invoke(app, ["recall", "--model", "preset:tiny", "--dataset", str(folder), "--segment", "200",
                                      "--trials", "2", "--out", str(out)])
    assert result.exit_code == 1
    assert str(folder) in result.output and "no N-free stretch of at least 400 bases" in result.output
    assert not out.exists()
