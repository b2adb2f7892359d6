"""Regions (samtools' chr2:1-1,800,000, 1-based, inclusive) through prepare and eval: the windows
cover exactly the region (checked base by base against pyfaidx), train and eval may share a
chromosome without overlapping, the manifest records the regions, and a bad region is one line,
exit 1, nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.data.prepare import PrepareRequest, prepare
from genome_lm.data.regions import Region, parse_region, split_regions
from genome_lm.data.windows import WindowSpec, plan_windows
from genome_lm.errors import GenomeLMError
from tests.data.test_prepare import check_against_pyfaidx, random_genome


@pytest.mark.parametrize("text,region", [
    ("chr2", Region("chr2")),
    ("chr2:1-1,800,000", Region("chr2", 0, 1_800_000)),
    ("chr2:1,800,001-2,333,275", Region("chr2", 1_800_000, 2_333_275)),
    ("chr2:1800001", Region("chr2", 1_800_000, None)),
    ("2:5-5", Region("2", 4, 5)),
])
def test_parse_region(text, region):
    assert parse_region(text) == region
    assert parse_region(str(region)) == region  # str writes it back in the same syntax


@pytest.mark.parametrize("text,words", [
    ("chr2:0-5", "1-based"), ("chr2:9-5", "ends"), ("chr2:1,80-90", "START or START-END"),
    ("chr2:1-2-3", "START or START-END"), ("", "empty"),
])
def test_bad_regions_are_one_line_errors(text, words):
    with pytest.raises(GenomeLMError, match=words):
        parse_region(text)


def test_a_record_named_like_a_region_is_a_record():
    name = "HLA-A*01:01:01:01"  # an hg38 alt contig
    assert parse_region(name, [name, "chr1"]) == Region(name)


def test_split_regions_keeps_thousands_separators():
    assert split_regions("chr1, chr2:1-1,800,000,chr22") == ("chr1", "chr2:1-1,800,000", "chr22")
    assert split_regions("chr2:1,800,001-2,333,275") == ("chr2:1,800,001-2,333,275",)
    assert split_regions("1,2,22") == ("1", "2", "22")  # Ensembl names are not thousands
    assert split_regions("") == ()


@pytest.mark.parametrize("tail", ["keep", "drop"])
def test_held_out_region_prepares_exactly_its_bases(tmp_path, rng, tail):
    fasta, records = random_genome(tmp_path, rng, names=("chr1", "chr2", "chr22"))
    n = len(records["chr2"])
    cut = n // 2 + 37  # uneven: neither part a multiple of the window
    train, eval_ = (f"chr2:1-{cut:,}", "chr1"), (f"chr2:{cut + 1:,}-{n:,}",)
    spec = WindowSpec(700, 700, tail, min_tail=100, max_n_fraction=1.0)
    manifest = prepare(PrepareRequest(fasta, tmp_path / "out", train, eval_, spec), workers=1, quiet=True).manifest
    check_against_pyfaidx(manifest, fasta, tmp_path, rng)
    for split, start, end in (("train", 0, cut), ("eval", cut, n)):
        data = manifest.split(split).data
        on_chr2 = sorted((w["start"], w["end"]) for w in data["windows"] + data["skipped"] if w["chrom"] == "chr2")
        planned = [(start + a, start + b) for a, b in plan_windows(end - start, spec)[0]]
        assert on_chr2 == planned and all(start <= a and b <= end for a, b in on_chr2)
        entry = next(c for c in data["chromosomes"] if c["record"] == "chr2")
        assert (entry["start"], entry["end"], entry["length"]) == (start, end, n)  # the manifest records it
    assert manifest.split("eval").data["chromosomes"][0]["requested"] == eval_[0]
    train_chr1 = [c for c in manifest.split("train").data["chromosomes"] if c["record"] == "chr1"][0]
    assert (train_chr1["start"], train_chr1["end"]) == (0, len(records["chr1"]))


def _cli(*args):
    return CliRunner().invoke(app, ["prepare", *args, "--quiet", "--workers", "1", "--window", "500",
                                    "--min-tail", "50"])


@pytest.mark.parametrize("train,eval_,words", [
    ("chr2:1-3,000", "chr2:2,500-4,000", r"'chr2:1-3,000' and 'chr2:2,500-4,000' overlap on record 'chr2' \(train and "
                                         r"eval\): bases 2,500-3,000"),
    ("chr2:1-3,000,chr2:3,000-3,500", "chr22", r"overlap on record 'chr2' \(both in train\)"),
    ("chr2:1-3,000", "2:1-10", "overlap"),  # another name for the same record
    ("chr2:1-99,999,999", "chr22", "reaches past the end of chr2"),
    ("chr2:5-1", "chr22", "ends .* before it starts"),
    ("chr2:0-10", "chr22", "1-based"),
])
def test_cli_bad_regions(tmp_path, rng, train, eval_, words):
    import re

    fasta, _ = random_genome(tmp_path, rng, names=("chr1", "chr2", "chr22"))
    before = sorted(p.name for p in tmp_path.iterdir())
    result = _cli("--fasta", str(fasta), "--out", str(tmp_path / "out"), "--train-chroms", train, "--eval-chroms",
                  eval_)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(words, lines[0]), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing written"


def test_eval_chooses_the_windows_inside_a_region():
    from types import SimpleNamespace

    from genome_lm.eval.evaluate import _windows_of

    windows = [SimpleNamespace(chrom=c, start=a, end=b) for c, a, b in
               [("chr2", 0, 500), ("chr2", 500, 1000), ("chr2", 1000, 1500), ("chr22", 0, 500)]]
    assert _windows_of(windows, "chr2", "m") == [0, 1, 2]
    assert _windows_of(windows, "2:501-1,500", "m") == [1, 2]
    assert _windows_of(windows, "chr2:600", "m") == [2]  # windows wholly inside only
    with pytest.raises(GenomeLMError, match="no evaluation window lies wholly inside chr2:1-499"):
        _windows_of(windows, "chr2:1-499", "m")
    assert np.array_equal(_windows_of(windows, "NC_000022.11", "m"), [3])
