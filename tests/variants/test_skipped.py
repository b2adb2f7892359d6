"""Skipped variants in words: a run that scores none says why in one line (counts per reason, no
Python dict), a run that scores some lists the others in skipped.tsv beside the report and says
so."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.variants import report as rep
from genome_lm.variants.vcf import Skipped
from tests.variants.test_schema import _built
from tests.variants.test_variants_cli import _write_inputs
from tests.variants.test_vcf import base, other, write_genome, write_vcf

WIDE = {"COLUMNS": "300"}  # no wrapping of the paths the output names


def test_no_variant_scored_names_the_reasons_in_words(tmp_path):
    fasta = write_genome(tmp_path)
    rows = [("1", p, other(p), base(p), "") for p in (100, 120, 140)]  # REF does not match
    rows.append(("1", 245, base(245), other(245), ""))  # its window runs into the N at 251-256
    vcf = write_vcf(tmp_path / "v.vcf", rows)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["variants", "--vcf", str(vcf), "--fasta", str(fasta), "--model",
                                      "builtin:tiny-long", "--contexts", "10", "--right", "10", "--out", str(out),
                                      "--quiet", "--no-tracking"], env=WIDE)
    assert result.exit_code == 1, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    message = lines[0]
    assert "{" not in message and "}" not in message and "'" not in message, message
    assert f"{vcf}: no variant could be scored: 4 skipped" in message, message
    assert "3 REF does not match the FASTA, 1 window runs into N" in message, message
    assert f"the first: 1:100 {other(100)}>{base(100)}, REF does not match the FASTA" in message, message
    assert not out.exists()


def test_the_written_files_list_the_skipped_variants(tmp_path):
    report, variants = _built(np.random.default_rng(3), labelled=False)
    skipped = [Skipped("17:5:A>T", "window runs into N", chrom="17", pos=5, ref="A", alt="T", id="rs1"),
               Skipped("17:9:A>C", "REF does not match the FASTA (G at chr17:9)", chrom="17", pos=9, ref="A",
                       alt="C")]
    n = len(variants)
    scores = {"model@64": {"sum": np.zeros(n), "mean": np.zeros(n)}}
    rep.write_outputs(report, variants, None, scores, {}, tmp_path, skipped=skipped)
    assert report.files["skipped"] == str(tmp_path / "skipped.tsv")
    rows = list(csv.DictReader((tmp_path / "skipped.tsv").open(), delimiter="\t"))
    assert rows == [
        {"variant": "17:5:A>T", "chrom": "17", "pos": "5", "ref": "A", "alt": "T", "id": "rs1",
         "reason": "window runs into N"},
        {"variant": "17:9:A>C", "chrom": "17", "pos": "9", "ref": "A", "alt": "C", "id": "",
         "reason": "REF does not match the FASTA (G at chr17:9)"}]
    assert json.loads((tmp_path / "variants.json").read_text())["files"]["skipped"] == report.files["skipped"]
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


@pytest.mark.slow
def test_a_partly_skipped_run_says_where_the_skipped_variants_are(tmp_path):
    vcf, fa = _write_inputs(tmp_path, np.random.default_rng(1))
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["variants", "--vcf", str(vcf), "--fasta", str(fa), "--model",
                                      "builtin:tiny-long", "--contexts", "60", "--right", "40", "--out", str(out),
                                      "--quiet", "--no-tracking"], env=WIDE)
    assert result.exit_code == 0, result.output
    listed = out / "skipped.tsv"
    summary = result.output.splitlines()[0]
    assert "2 skipped: 1 REF does not match the FASTA, 1 window runs into N" in summary, result.output
    assert f"listed in {listed}" in summary, result.output
    assert f"skipped: {listed}" in result.output  # among the written files
    rows = list(csv.DictReader(listed.open(), delimiter="\t"))
    assert [(r["chrom"], r["pos"], r["reason"].split(" (")[0]) for r in rows] == [
        ("5", "700", "REF does not match the FASTA"), ("5", "2480", "window runs into N")]
    report = json.loads((out / "variants.json").read_text())
    assert [s["variant"] for s in report["data"]["skipped_variants"]] == [r["variant"] for r in rows]
    assert report["files"]["skipped"] == str(listed)
