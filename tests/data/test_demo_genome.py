"""The synthetic demo genome: checked against its description by independent computations."""

from __future__ import annotations

import json
import re

import numpy as np
import pyfaidx
import pytest

from genome_lm.data import demo_genome
from genome_lm.data.demo_genome import (
    CHROM_LENGTHS,
    PlantedCopy,
    generate_demo_genome,
    n_events,
    plan_copies,
    planted_json_path,
    write_demo_genome,
)
from genome_lm.errors import GenomeLMError

SCALE = 0.1
_COMPLEMENT = bytes.maketrans(b"ACGTacgt", b"TGCAtgca")


@pytest.fixture(scope="module")
def genome():
    return generate_demo_genome(seed=3, scale=SCALE)


def _reverse_complement(seq: bytes) -> bytes:
    return seq[::-1].translate(_COMPLEMENT)


def _mismatches(a: bytes, b: bytes) -> int:
    return int((np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)).sum())


def _n_runs(seq: bytes) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(rb"N+", seq)]


def test_same_seed_gives_identical_bytes_and_other_seeds_differ():
    a, b = generate_demo_genome(seed=11, scale=0.05), generate_demo_genome(seed=11, scale=0.05)
    c = generate_demo_genome(seed=12, scale=0.05)
    assert a.records == b.records and a.planted == b.planted
    assert a.planted != c.planted
    for seq_a, seq_c in zip(a.records.values(), c.records.values()):
        # Unrelated sequences agree at ~25% of positions; a shared stream would agree far more.
        assert len(seq_a) - _mismatches(seq_a, seq_c) < 0.4 * len(seq_a)


def test_record_names_and_lengths(genome):
    assert list(genome.records) == ["chr1", "chr2", "chr22"]
    assert {name: len(seq) for name, seq in genome.records.items()} == {
        "chr1": 400_000,
        "chr2": 300_000,
        "chr22": 200_000,
    }
    assert genome.seed == 3 and genome.scale == SCALE


def test_only_valid_letters(genome):
    for seq in genome.records.values():
        assert set(seq) <= set(b"ACGTNacgt")  # N is never soft-masked


def test_soft_masked_fraction_is_realistic(genome):
    for seq in genome.records.values():
        lower = sum(seq.count(c) for c in b"acgt")
        assert 0.33 < lower / (len(seq) - seq.count(b"N")) < 0.47


def test_cpg_is_depleted(genome):
    for seq in genome.records.values():
        upper = seq.upper()
        bases = len(upper) - upper.count(b"N")
        observed_over_expected = upper.count(b"CG") * bases / (upper.count(b"C") * upper.count(b"G"))
        assert 0.1 < observed_over_expected < 0.4


def test_microsatellites_are_present_and_soft_masked(genome):
    # A perfect tandem repeat of a 1-6 bp unit over >= 20 bp almost never occurs by chance.
    def tandem_runs(seq: bytes, letters: str) -> int:
        pattern = re.compile(rb"([%s]{1,6}?)\1{3,}" % letters.encode())
        return sum(m.end() - m.start() >= 20 for m in pattern.finditer(seq))

    for seq in genome.records.values():
        anywhere = tandem_runs(seq.upper(), "ACGT")
        assert anywhere >= 30
        assert tandem_runs(seq, "acgt") >= 0.9 * anywhere


def test_gc_content_varies_along_the_genome(genome):
    fractions = []
    for seq in genome.records.values():
        upper = seq.upper()
        for start in range(0, len(upper) - 20_000 + 1, 20_000):
            window = upper[start : start + 20_000]
            acgt = len(window) - window.count(b"N")
            if acgt > 15_000:
                fractions.append((window.count(b"G") + window.count(b"C")) / acgt)
    assert max(fractions) - min(fractions) > 0.05


def test_chr22_starts_with_a_long_n_run_and_every_chromosome_has_internal_gaps(genome):
    for name, seq in genome.records.items():
        runs = _n_runs(seq)
        if name == "chr22":
            assert runs[0] == (0, round(0.10 * len(seq)))
            runs = runs[1:]
        else:
            assert not seq.startswith(b"N")
        assert len(runs) >= 2
        assert all(1 <= end - start <= 50_000 for start, end in runs)


def test_every_planted_copy_matches_its_source_up_to_its_divergence(genome):
    kinds = set()
    for copy in genome.planted:
        seq = genome.records[copy.chrom]
        src, dst = seq[copy.src_start : copy.src_end], seq[copy.dst_start : copy.dst_end]
        expected = src if copy.kind == "duplication" else _reverse_complement(src)
        assert len(dst) == len(src) and 300 <= len(src) <= 3000
        assert 0 <= copy.divergence <= 0.01
        assert copy.distance == copy.dst_start - copy.src_start >= 1000
        # Substitutions keep the soft-mask, so case matches too (for inversions, reversed).
        assert _mismatches(expected, dst) == _mismatches(expected.upper(), dst.upper())
        assert _mismatches(expected.upper(), dst.upper()) == round(copy.divergence * len(dst))
        kinds.add(copy.kind)
    assert kinds == {"duplication", "inversion"}
    assert any(copy.divergence > 0 for copy in genome.planted)


def test_planted_intervals_do_not_overlap_each_other_or_n_gaps(genome):
    for name, seq in genome.records.items():
        copies = [c for c in genome.planted if c.chrom == name]
        assert len(copies) == n_events(len(seq))
        intervals = _n_runs(seq)
        intervals += [(c.src_start, c.src_end) for c in copies] + [(c.dst_start, c.dst_end) for c in copies]
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:]):
            assert end <= start


def test_distances_span_1_kbp_to_hundreds_of_kbp_at_scale_1():
    rng = np.random.default_rng(5)
    for name, length in CHROM_LENGTHS.items():
        occupied = np.zeros(length, dtype=bool)
        occupied[: round(0.1 * length) if name == "chr22" else 0] = True
        planned = plan_copies(rng, name, occupied, n_events(length))
        assert len(planned) == n_events(length) >= 100
        distances = np.array([c.distance for c in planned])
        assert distances.min() >= 1000 and distances.max() <= 500_000
        # Log-uniform: every decade of distance holds a good share of the events.
        for lo, hi in [(1_000, 10_000), (10_000, 100_000), (100_000, 500_001)]:
            assert ((distances >= lo) & (distances < hi)).sum() >= 0.15 * len(planned)


def test_written_fasta_reads_back_with_pyfaidx(tmp_path):
    path = write_demo_genome(tmp_path / "demo.fa", seed=4, scale=0.05)
    genome = generate_demo_genome(seed=4, scale=0.05)
    lines = path.read_bytes().split(b"\n")
    assert lines[0] == b">chr1" and max(len(line) for line in lines) == 60
    fasta = pyfaidx.Fasta(str(path), as_raw=True, sequence_always_upper=False)
    assert list(fasta.keys()) == list(genome.records)
    for name, seq in genome.records.items():
        assert fasta[name][:].encode() == seq


def test_planted_sidecar_round_trips(tmp_path):
    path = write_demo_genome(tmp_path / "demo.fa", seed=4, scale=0.05)
    genome = generate_demo_genome(seed=4, scale=0.05)
    sidecar = json.loads(planted_json_path(path).read_text())
    assert planted_json_path(path) == tmp_path / "demo.planted.json"
    assert sidecar["schema"] == "genome-lm.demo-planted/1"
    assert (sidecar["seed"], sidecar["scale"]) == (4, 0.05)
    assert sidecar["records"] == {name: len(seq) for name, seq in genome.records.items()}
    assert [PlantedCopy(**p) for p in sidecar["planted"]] == genome.planted
    assert "inversion" in sidecar["description"]


def test_a_failed_write_leaves_the_previous_file_and_no_temp_files(tmp_path, monkeypatch):
    path = tmp_path / "demo.fa"
    path.write_bytes(b">old\nACGT\n")

    def killed(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo_genome.os, "replace", killed)
    with pytest.raises(GenomeLMError, match="demo.fa"):
        write_demo_genome(path, seed=0, scale=0.05)
    assert path.read_bytes() == b">old\nACGT\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.fa"]


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 0.001])
def test_bad_scale_is_a_user_error(scale):
    with pytest.raises(GenomeLMError, match="scale"):
        generate_demo_genome(seed=0, scale=scale)


def test_the_default_copy_plan_keeps_the_genome_of_before_copy_plans_existed():
    # sha256 of the records of generate_demo_genome(seed=4, scale=0.05) computed with the code of
    # 65518d0, before CopyPlan: the default demo genome (and every figure made on it) is unchanged
    import hashlib

    genome = generate_demo_genome(seed=4, scale=0.05)
    digest = hashlib.sha256(b"".join(genome.records.values())).hexdigest()
    assert digest == "aa467c4c5d1b10395ffb0b287bf52d9c7f4360c4964e003ecbbd39b16de4a574"
    assert len(genome.planted) == 23


def test_a_copy_plan_sets_count_lengths_distances_and_kinds(tmp_path):
    from genome_lm.data.demo_genome import CopyPlan

    plan = CopyPlan(per_mbp=400, length_bp=(100, 1000), distance_bp=(256, 16384), inversions=0.0)
    path = write_demo_genome(tmp_path / "dense.fa", seed=2, scale=0.05, copies=plan)
    genome = generate_demo_genome(seed=2, scale=0.05, copies=plan)
    fasta = pyfaidx.Fasta(str(path), as_raw=True, sequence_always_upper=False)
    for name, seq in genome.records.items():
        copies = [c for c in genome.planted if c.chrom == name]
        assert len(copies) == n_events(len(seq), 400) > n_events(len(seq))
        for c in copies:
            assert c.kind == "duplication" and 256 <= c.distance <= 16384
            assert 100 <= c.src_end - c.src_start <= min(1000, c.distance)
            src, dst = fasta[name][c.src_start:c.src_end], fasta[name][c.dst_start:c.dst_end]
            assert _mismatches(src.encode(), dst.encode()) <= 0.01 * len(src)
    sidecar = json.loads(planted_json_path(path).read_text())
    assert sidecar["copies"] == {"per_mbp": 400, "length_bp": [100, 1000], "distance_bp": [256, 16384],
                                 "inversions": 0.0}
    assert "Forward duplications of 100-1000 bp" in sidecar["description"] and "inversion" not in sidecar["description"]
    inverted = generate_demo_genome(seed=2, scale=0.05, copies=CopyPlan(inversions=1.0))
    assert {c.kind for c in inverted.planted} == {"inversion"}


@pytest.mark.parametrize("changes, match", [({"per_mbp": -1}, "per Mbp"), ({"length_bp": (10, 5)}, "lengths"),
                                            ({"distance_bp": (0, 5)}, "distances"), ({"inversions": 1.5}, "inversion")])
def test_a_bad_copy_plan_is_a_user_error(changes, match):
    from genome_lm.data.demo_genome import CopyPlan

    with pytest.raises(GenomeLMError, match=match):
        CopyPlan(**changes)


def test_demo_genome_command_takes_a_copy_plan(tmp_path):
    from typer.testing import CliRunner

    from genome_lm.cli import app

    out = tmp_path / "g.fa"
    result = CliRunner().invoke(app, ["demo-genome", "--out", str(out), "--scale", "0.05", "--copies-per-mbp", "300",
                                      "--copy-distance", "256-4k", "--copy-length", "100-500", "--inversions", "0.25"])
    assert result.exit_code == 0, result.output
    sidecar = json.loads(planted_json_path(out).read_text())
    assert sidecar["copies"] == {"per_mbp": 300, "length_bp": [100, 500], "distance_bp": [256, 4096],
                                 "inversions": 0.25}
    bad = CliRunner().invoke(app, ["demo-genome", "--out", str(out), "--copy-distance", "4k-1k"])
    assert bad.exit_code != 0 and "--copy-distance" in bad.output


def _repeated_kmers(seq: bytes, k: int, window: int) -> float:
    """Fraction of k-mers that also start at some position at most ``window`` before them."""
    last, hits = {}, 0
    for i in range(len(seq) - k + 1):
        kmer = seq[i:i + k]
        if kmer in last and i - last[kmer] <= window:
            hits += 1
        last[kmer] = i
    return hits / (len(seq) - k + 1)


def test_the_copy_drill_mostly_repeats_what_came_shortly_before():
    from genome_lm.data.demo_genome import copy_drill

    codes = copy_drill(np.random.default_rng(7), 200_000, (64, 4096))
    assert codes.shape == (200_000,) and codes.max() <= 3
    again = copy_drill(np.random.default_rng(7), 200_000, (64, 4096))
    assert np.array_equal(codes, again)
    # a 20-mer recurs by chance in 4k random bases with probability ~4e-9: what recurs was copied
    drill = _repeated_kmers(codes.tobytes(), 20, 4096)
    background = _repeated_kmers(np.random.default_rng(8).integers(0, 4, 200_000).astype(np.uint8).tobytes(), 20, 4096)
    assert drill > 0.4 and background == 0
    assert 0.2 < np.bincount(codes, minlength=4).min() / len(codes)  # uniform bases


def test_a_drill_record_is_added_only_when_asked_and_leaves_the_chromosomes_alone(tmp_path):
    plain = generate_demo_genome(seed=5, scale=0.05)
    drilled = generate_demo_genome(seed=5, scale=0.05, drill_bp=50_000)
    assert list(drilled.records) == [*plain.records, "drill"] and "drill" not in plain.records
    assert all(drilled.records[name] == seq for name, seq in plain.records.items())
    assert drilled.planted == plain.planted and len(drilled.records["drill"]) == 50_000
    assert set(drilled.records["drill"]) <= set(b"ACGT")


def test_demo_genome_command_adds_a_drill(tmp_path):
    from typer.testing import CliRunner

    from genome_lm.cli import app

    out = tmp_path / "g.fa"
    result = CliRunner().invoke(app, ["demo-genome", "--out", str(out), "--scale", "0.05", "--drill", "64k"])
    assert result.exit_code == 0, result.output
    fasta = pyfaidx.Fasta(str(out), as_raw=True)
    assert list(fasta.keys())[-1] == "drill" and len(fasta["drill"]) == 65536
