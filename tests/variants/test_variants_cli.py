"""`genome-lm variants` end to end on a small VCF the test writes: the per-variant scores equal
two direct forwards through transformers' glm5_next (the reference and the alternative window,
each scored whole), AUROC equals scikit-learn's, and every output is written. On the real
Findlay BRCA1 set (skipped when ../shared is absent): every variant scored, the outputs readable."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pysam
import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.variants.schema import VariantsReport
from tests.model.hf_oracle import make_checkpoint


def revcomp(seq: str) -> str:
    return seq.translate(str.maketrans("ACGT", "TGCA"))[::-1]


SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "variants"

ORACLE = r"""
import json, sys
import numpy as np, torch
from genome_lm.eval.probes.logprobs import _transformers_logprobs
from genome_lm.data.tokenizer import tokenize
hf, windows = sys.argv[1], json.loads(sys.stdin.read())
out = []
for ref, alt, offset in windows:
    sums = []
    for w in (ref, alt):
        ids = torch.from_numpy(tokenize(w.encode()).astype(np.int64))[None]
        lp = _transformers_logprobs(hf, ids, torch.float32)  # log p of w[1:]
        sums.append(float(lp[offset - 1:].sum()))
    out.append(sums[1] - sums[0])
print(json.dumps(out))
"""


def _write_inputs(folder: Path, rng) -> tuple[Path, Path]:
    seq = "".join(rng.choice(list("ACGT"), 3000))
    seq = seq[:2500] + "N" * 100 + seq[2600:]  # a stretch of N that one variant's window runs into
    fa = folder / "ref.fa"
    fa.write_text(">chr5\n" + "\n".join(seq[i:i + 60] for i in range(0, len(seq), 60)) + "\n")
    pysam.faidx(str(fa))
    header = pysam.VariantHeader()
    header.contigs.add("5", length=len(seq))  # the VCF says 5, the FASTA chr5
    header.info.add("CLASS", 1, "String", "label")
    header.info.add("SCORE", 1, "Float", "another method's score")
    vcf = folder / "v.vcf"
    records = []
    for pos in sorted(rng.choice(np.arange(400, 2300), 14, replace=False)):
        ref = seq[pos - 1]
        alts = [b for b in "ACGT" if b != ref][: 1 + pos % 2]  # some multi-allelic records
        records.append((int(pos), ref, alts))
    d = 1234
    records.append((d, seq[d - 1:d + 2], [seq[d - 1]]))  # a 2-base deletion (anchor base kept)
    records.append((1500, seq[1499], [seq[1499] + "GAT"]))  # a 3-base insertion
    records.append((2480, seq[2479], ["A" if seq[2479] != "A" else "C"]))  # N in its window: skipped
    records.append((700, "A" if seq[699] != "A" else "C", ["G"]))  # REF does not match: skipped
    with pysam.VariantFile(str(vcf), "w", header=header) as out:
        for i, (pos, ref, alts) in enumerate(sorted(records)):
            r = out.new_record(contig="5", start=pos - 1, alleles=(ref, *alts))
            r.info["CLASS"] = "bad" if i % 3 == 0 else "fine"
            r.info["SCORE"] = float(i)
            out.write(r)
    return vcf, fa


@pytest.mark.slow
def test_scores_equal_two_transformers_forwards_and_auroc_equals_sklearn(tmp_path):
    from sklearn.metrics import roc_auc_score

    from genome_lm.variants.vcf import Reference, read_variants, windows

    rng = np.random.default_rng(7)
    vcf, fa = _write_inputs(tmp_path, rng)
    hf = make_checkpoint(tmp_path / "hf", seed=5)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["variants", "--vcf", str(vcf), "--fasta", str(fa), "--model", str(hf),
                                      "--contexts", "60,200", "--right", "40", "--label", "CLASS", "--positive", "bad",
                                      "--compare", "SCORE", "--out", str(out), "--quiet", "--resamples", "100",
                                      "--no-tracking"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "variants.json").read_text())
    assert VariantsReport.from_json(report).to_json() == report  # the typed report reads it back whole
    assert report["data"]["skipped"] == 2 and set(report["data"]["skipped_by_reason"]) >= {"window runs into N"}
    rows = list(csv.DictReader((out / "variants.tsv").open(), delimiter="\t"))
    assert len(rows) == report["data"]["variants"] > 14
    assert {r["kind"] for r in rows} == {"snv", "deletion", "insertion"}
    for f in ("roc.png", "auroc_by_context.png"):
        assert (out / f).stat().st_size > 0

    found = read_variants(vcf, fa, left=200, right=40)
    with Reference(fa) as ref:
        for L in (60, 200):
            wins = [windows(v, ref, L, 40) for v in found.variants]
            oracle = subprocess.run([sys.executable, "-c", ORACLE, str(hf)], input=json.dumps(wins), text=True,
                                    capture_output=True, timeout=600, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
            assert oracle.returncode == 0, oracle.stderr[-3000:]
            want = np.array(json.loads(oracle.stdout))
            got = np.array([float(r[f"model@{L} llr_sum"]) for r in rows])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # --rc: the mean of the forward score and the reverse strand's (the windows reverse-complemented,
    # 60 bases of the strand's own preceding context: what follows the variant on the forward one)
    rc_out = tmp_path / "report-rc"
    result = CliRunner().invoke(app, ["variants", "--vcf", str(vcf), "--fasta", str(fa), "--model", str(hf),
                                      "--contexts", "60", "--right", "40", "--rc", "--out", str(rc_out), "--quiet",
                                      "--no-tracking"])
    assert result.exit_code == 0, result.output
    rc_rows = list(csv.DictReader((rc_out / "variants.tsv").open(), delimiter="\t"))
    found = read_variants(vcf, fa, left=60, right=60)
    with Reference(fa) as ref:
        forward = [windows(v, ref, 60, 40) for v in found.variants]
        reverse = []
        for v in found.variants:
            r, a, _ = windows(v, ref, 40, 60)
            reverse.append((revcomp(r), revcomp(a), 60))
    both = []
    for wins in (forward, reverse):
        oracle = subprocess.run([sys.executable, "-c", ORACLE, str(hf)], input=json.dumps(wins), text=True,
                                capture_output=True, timeout=600, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
        assert oracle.returncode == 0, oracle.stderr[-3000:]
        both.append(np.array(json.loads(oracle.stdout)))
    got = np.array([float(r["model@60 llr_sum"]) for r in rc_rows])
    np.testing.assert_allclose(got, (both[0] + both[1]) / 2, rtol=1e-4, atol=1e-4)
    assert np.abs(both[0] - both[1]).max() > 1e-3  # the two strands differ: the average is not one of them

    labels = np.array([int(r["label"]) for r in rows])
    got = report["metrics"]["overall"]["model@200"]["auroc"]["value"]
    assert got == pytest.approx(roc_auc_score(labels, -np.array([float(r["model@200 llr_sum"]) for r in rows])))
    assert report["metrics"]["overall"]["SCORE"]["auroc"]["value"] == pytest.approx(
        roc_auc_score(labels, [float(r["SCORE"]) for r in rows]))


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    rng = np.random.default_rng(1)
    vcf, fa = _write_inputs(tmp_path, rng)
    out = tmp_path / "report"
    cases = [(["--vcf", str(tmp_path / "missing.vcf"), "--fasta", str(fa)], "missing.vcf"),
             (["--vcf", str(vcf), "--fasta", str(tmp_path / "missing.fa")], "missing.fa"),
             (["--vcf", str(vcf), "--fasta", str(fa), "--label", "NOPE", "--positive", "x"], "NOPE"),
             (["--vcf", str(vcf), "--fasta", str(fa), "--strict"], "REF")]
    for args, named in cases:
        result = CliRunner().invoke(app, ["variants", *args, "--model", "builtin:tiny-long", "--contexts", "60",
                                          "--right", "40", "--out", str(out), "--quiet", "--no-tracking"])
        assert result.exit_code == 1, (args, result.output)
        lines = [x for x in result.output.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], result.output
        assert not out.exists()


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/variants is not here")
def test_the_findlay_set_end_to_end(tmp_path):
    out = tmp_path / "findlay"
    result = CliRunner().invoke(app, [
        "variants", "--vcf", str(SHARED / "findlay2018_brca1_sge.vcf.gz"), "--fasta", str(SHARED / "brca1_hg19.fa.gz"),
        "--model", "builtin:tiny-long", "--contexts", "64,256", "--right", "64", "--rc", "--label", "FUNC_CLASS",
        "--positive", "LOF", "--compare", "CADD,PHYLOP", "--max-variants", "300", "--out", str(out), "--quiet",
        "--resamples", "200"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "variants.json").read_text())
    assert VariantsReport.from_json(report).mlflow.run_id == report["mlflow"]["run_id"]
    assert report["data"]["variants"] == 300 and report["data"]["skipped"] == 0
    overall = report["metrics"]["overall"]
    assert {"model@64", "model@256", "markov", "CADD", "PHYLOP"} <= set(overall)
    for entry in overall.values():
        lo, hi = entry["auroc"]["ci"]
        assert 0 <= lo <= entry["auroc"]["value"] <= hi <= 1
    assert report["mlflow"]["run_id"]
    assert "AUROC" in result.output
