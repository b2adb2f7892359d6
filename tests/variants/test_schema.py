"""The typed variant report: a report built from random scores survives JSON exactly, a file of
the dict-writing release reads and is written back key for key, and a document that does not fit
is refused with the place of the first value that does not."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from genome_lm.eval.schema import MlflowInfo, ModelInfo
from genome_lm.variants import report as rep
from genome_lm.variants.run import VariantRequest
from genome_lm.variants.schema import SCHEMA, MarkovInfo, Metrics, Models, ScoreMetrics, Settings, VariantsReport
from genome_lm.variants.vcf import Skipped, Variant


def _built(rng, labelled=True) -> tuple[VariantsReport, list[Variant]]:
    """A report from random scores through the report's own functions: two contexts, a baseline,
    a --compare field, two consequence classes (one too small for its own AUROC)."""
    n = 240
    variants = [Variant(chrom="17", contig="chr17", pos=1000 + 7 * i, ref="A", alt="CG"[i % 2] if i % 5 else "AT",
                        info={"CONSEQUENCE": "missense" if i < 230 else "intron"}) for i in range(n)]
    labels = (rng.random(n) < 0.4).astype(np.int64) if labelled else None
    scores = {f"{who}@{L}": {"sum": rng.normal(size=n), "mean": rng.normal(size=n)}
              for who in ("model", "baseline") for L in (64, 256)}
    scores["markov"] = {"sum": rng.normal(size=n), "mean": rng.normal(size=n)}
    compare = {"CADD": np.where(rng.random(n) < 0.1, np.nan, rng.normal(size=n))}
    req = VariantRequest(vcf="x.vcf.gz", fasta="x.fa", model="m", out="o", contexts=[256, 64], label="FUNC",
                         positive=("LOF",), compare=("CADD",), resamples=60, seed=3)
    skipped = [Skipped("17:5:A>T", "window runs into N (17:5)"), Skipped("17:9:A>C", "REF does not match")]
    report = VariantsReport(
        created="2026-12-07T00:00:00+00:00", genome_lm="0.1.0", seconds=12.5,
        settings=Settings(vcf="x.vcf.gz", fasta="x.fa", contexts=[64, 256], right=63, reverse_complement=True,
                          score="sum", max_indel=50, label="FUNC", positive=["LOF"], negative=None, compare=["CADD"],
                          resamples=60, seed=3, chunk=None),
        models=Models(model=ModelInfo(kind="checkpoint", path="run/checkpoints/step-000010", step=10, preset="tiny"),
                      baseline=ModelInfo(kind="init", checkpoint="builtin:tiny-long"),
                      markov=MarkovInfo(order=8, fitted_on=["chr17"], bases=81_000)),
        data=rep.data_summary(variants, labels, skipped),
        metrics=rep.metrics(scores, compare, labels, variants, req) if labelled else None)
    report.summary = rep.summary(report)
    return report, variants


@pytest.mark.parametrize("labelled", [True, False])
def test_a_built_report_survives_json_exactly(labelled):
    report, _ = _built(np.random.default_rng(11), labelled)
    text = json.dumps(report.to_json(), allow_nan=False)
    back = VariantsReport.from_json(json.loads(text))
    assert back == report
    assert json.dumps(back.to_json(), allow_nan=False) == text
    if labelled:
        m = back.metrics
        assert isinstance(m, Metrics) and isinstance(m.overall["model@256"], ScoreMetrics)
        assert set(m.by_consequence) == {"missense"}  # 10 intron variants: too few for their own AUROC
        assert m.overall["CADD"].n < 240  # the variants with no CADD value left out
        assert {(d.a, d.b) for d in m.differences} >= {("model@256", "markov"), ("model@256", "baseline@256"),
                                                       ("model@256", "model@64"), ("model@64", "CADD")}
        assert "positives" in text and back.data.positives + back.data.negatives == 240
    else:
        assert back.metrics is None and '"positives"' not in text and back.summary[-1].startswith("no --label")
    assert back.data.skipped_by_reason == {"window runs into N": 1, "REF does not match": 1}
    assert "mlflow" not in json.loads(text)  # untracked: no entry rather than an empty one


def test_a_file_of_the_dict_writing_release_reads_and_writes_back():
    """variants.json as the release before the types wrote it (markov without a kind, an
    unavailable MLflow as {}): read, it gives the same JSON back, the empty MLflow entry with
    its keys."""
    report, _ = _built(np.random.default_rng(2))
    old = report.to_json()
    old["mlflow"] = {}
    old["models"]["model"] = {"kind": "huggingface", "path": "/w/tiny-long", "step": None,
                              "shipped": "builtin:tiny-long", "model_type": "glm5_next"}
    old["models"].pop("baseline")
    back = VariantsReport.from_json(copy.deepcopy(old))
    nulls = {"tracking_uri": None, "run_id": None, "experiment_id": None, "location": None}
    assert back.to_json() == {**old, "mlflow": nulls}  # the empty entry comes back with its keys, null
    assert back.mlflow == MlflowInfo() and back.models.baseline is None and back.models.model.shipped


@pytest.mark.parametrize(("edit", "place"), [
    (lambda d: d["metrics"]["overall"]["model@64"]["auroc"].update(value="high"),
     "metrics.overall.model@64.auroc.value: expected a number"),
    (lambda d: d["metrics"]["differences"][0].update(ci=[0.1]), "metrics.differences[0].ci: expected a list of 2"),
    (lambda d: d["data"].update(kinds={"snv": 1.5}), "data.kinds.snv: expected an integer"),
    (lambda d: d["models"].pop("markov"), "models.markov: missing"),
    (lambda d: d["settings"].update(reverse_complement="yes"), "settings.reverse_complement: expected true or false"),
    (lambda d: d["data"]["skipped_variants"][1].update(why="x"), "data.skipped_variants[1]: unknown key 'why'"),
    (lambda d: d.update(extra=1), "unknown key 'extra'"),
])
def test_a_document_that_does_not_fit_is_refused_with_its_place(edit, place):
    report, _ = _built(np.random.default_rng(5))
    data = report.to_json()
    edit(data)
    with pytest.raises(ValueError, match=place.replace("[", r"\[").replace("]", r"\]")):
        VariantsReport.from_json(data)


def test_another_schema_is_refused_by_name():
    report, _ = _built(np.random.default_rng(6))
    data = report.to_json()
    assert data["schema"] == SCHEMA
    with pytest.raises(ValueError, match="genome-lm.eval/1"):
        VariantsReport.from_json({**data, "schema": "genome-lm.eval/1"})


def test_the_written_files_read_back_as_the_report(tmp_path):
    """write_outputs: variants.json is the report with its files, the TSV has a row per variant,
    and both figures are drawn from the typed metrics."""
    rng = np.random.default_rng(9)
    report, variants = _built(rng)
    n = len(variants)
    labels = np.array([1 if i % 3 == 0 else 0 for i in range(n)])
    scores = {f"model@{L}": {"sum": rng.normal(size=n), "mean": rng.normal(size=n)} for L in (64, 256)}
    rep.write_outputs(report, variants, labels, scores, {}, tmp_path)
    back = VariantsReport.from_json(json.loads((tmp_path / "variants.json").read_text()))
    assert back == report and set(back.files) == {"json", "tsv", "roc", "by_context"}
    for key in ("roc", "by_context"):
        assert (tmp_path / back.files[key]).stat().st_size > 1000
    assert len((tmp_path / "variants.tsv").read_text().splitlines()) == n + 1
