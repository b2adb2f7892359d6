"""The typed evaluation report: eval.json round-trips through ``EvalReport`` unchanged, a report
built from scores survives JSON exactly, and a document that does not fit is refused with the
place of the first value that does not."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from genome_lm.eval import ablation, planted, report
from genome_lm.eval.schema import (
    SCHEMA,
    Bootstrap,
    BucketDelta,
    BucketStat,
    Data,
    EvalReport,
    ModelInfo,
    Planted,
    Settings,
)
from genome_lm.eval.score import TokenScores


def test_an_eval_json_round_trips_through_the_dataclasses(evaluated):
    out, data, _ = evaluated
    typed = EvalReport.from_json(data)
    assert typed.to_json() == data
    assert json.loads(json.dumps(typed.to_json(), allow_nan=False)) == data
    assert isinstance(typed.results["model"].buckets[0], BucketStat) and typed.models["model"].kind == "checkpoint"
    assert typed.results["model"].buckets[1].start == data["results"]["model"]["buckets"][1]["from"]
    assert isinstance(typed.planted, Planted)  # the demo genome's planted copies
    assert typed.mlflow.run_id == data["mlflow"]["run_id"]


def _scores(rng, n_windows=6, length=400, shift=0.0):
    context = np.tile(np.arange(1, length + 1), n_windows)
    window = np.repeat(np.arange(n_windows), length)
    soft = rng.random(context.size) < 0.3
    return TokenScores(rng.gamma(2.0, 0.6, context.size) + shift, context, window, soft)


def _built_report(rng) -> EvalReport:
    """A report with every optional part, from random scores: a baseline (comparison), an
    ablation with the baseline cut too (gain, beyond) and planted copies; a bucket with no
    token gives null statistics."""
    model, base = _scores(rng), _scores(rng, shift=0.1)
    edges = [0, 64, 256, 401, 800]  # contexts 1-400: the last bucket holds no token
    results, comparison = report.summarize({"model": model, "baseline": base}, edges, resamples=50, seed=1)
    cut = TokenScores(model.nll + 0.01, model.context, model.window, model.softmasked)
    base_cut = TokenScores(base.nll + 0.02, base.context, base.window, base.softmasked)
    ablated = ablation.summarize(model, {64: cut}, edges, resamples=50, seed=1, baseline=(base, {64: base_cut}))

    class Win:
        def __init__(self, start):
            self.chrom, self.start = "chr22", start

    windows = [Win(i * 400) for i in range(6)]
    copies = [{"chrom": "chr22", "kind": "duplication", "src_start": 10, "src_end": 110, "dst_start": 150,
               "dst_end": 250}, {"chrom": "chr22", "kind": "inversion", "src_start": 100, "src_end": 200,
                                 "dst_start": 900, "dst_end": 1000}]
    section = planted.analyse({"model": model, "baseline": base}, windows, copies, resamples=50, seed=1)
    built = EvalReport(created="2026-12-07T00:00:00+00:00", genome_lm="0.1.0",
                       data=Data(dataset="ds", split="eval", chrom="chr22", source=None, windows=list(range(6)),
                                 window_length=400, tokens=2400, tokens_softmasked=int(model.softmasked.sum())),
                       settings=Settings(chunk=None, edges=edges,
                                         bootstrap=Bootstrap(resamples=50, seed=1, level=0.95)),
                       models={"model": ModelInfo(kind="checkpoint", path="run", step=2),
                               "baseline": ModelInfo(kind="init", path="run", step=0, preset="tiny")},
                       results=results, comparison=comparison, ablation=ablated, planted=section)
    built.headline = report.headline(built)
    return built


def test_a_built_report_survives_json_exactly():
    built = _built_report(np.random.default_rng(0))
    assert built.results["model"].buckets[-1].nats is None and built.comparison.buckets[-1].change is None
    (cut,) = built.ablation.cuts
    assert isinstance(cut.gain.buckets[0], BucketDelta) and cut.beyond.start == 128
    text = json.dumps(built.to_json(), allow_nan=False)
    again = EvalReport.from_json(json.loads(text))
    assert again == built
    assert "baseline" not in json.loads(text)["settings"]  # None-valued optional keys are left out
    assert any("fell" in line or "rose" in line for line in again.headline)


def _place(data, path, value):
    *parents, last = path
    for key in parents:
        data = data[key]
    if value is KeyError:
        del data[last]
    else:
        data[last] = value


@pytest.mark.parametrize("path, value, message", [
    (("results", "model", "buckets", 1, "nats"), "x",
     r"results\.model\.buckets\[1\]\.nats: expected a number, got 'x'"),
    (("results", "model", "all", "tokens"), 1.5, r"results\.model\.all\.tokens: expected an integer"),
    (("results", "model", "all", "tokens"), True, r"results\.model\.all\.tokens: expected an integer"),
    (("results", "model", "all", "nats_ci"), [0.1], r"results\.model\.all\.nats_ci: expected a list of 2"),
    (("comparison", "all", "surprise"), 1, r"comparison\.all: unknown key 'surprise'"),
    (("data",), KeyError, r"^data: missing"),
    (("ablation", "cuts", 0, "gain", "beyond", "from"), "far", r"ablation\.cuts\[0\]\.gain\.beyond\.from: expected"),
    (("planted", "models", "model", "advantage", "excludes_zero"), 1, r"excludes_zero: expected true or false"),
])
def test_a_document_that_does_not_fit_names_the_place(path, value, message):
    data = _built_report(np.random.default_rng(1)).to_json()
    _place(data, path, value)
    with pytest.raises(ValueError, match=message):
        EvalReport.from_json(data)


def test_another_schema_is_refused_by_name():
    data = _built_report(np.random.default_rng(2)).to_json()
    with pytest.raises(ValueError, match="genome-lm.eval/0.*reads " + SCHEMA):
        EvalReport.from_json({**data, "schema": "genome-lm.eval/0"})
    with pytest.raises(ValueError, match="schema None"):
        EvalReport.from_json([data])


def test_a_report_of_an_earlier_release_still_reads():
    """Fields added to schema 1 after its first release have defaults: files written before them
    read, the missing parts None."""
    data = _built_report(np.random.default_rng(3)).to_json()
    old = copy.deepcopy(data)
    del old["data"]["tokens_softmasked"], old["settings"]["bootstrap"]["unit"]
    for cut in old["ablation"]["cuts"]:
        del cut["beyond"], cut["gain"], cut["baseline"]
    typed = EvalReport.from_json(old)
    assert typed.data.tokens_softmasked is None and typed.settings.bootstrap.unit == "window"
    written = typed.to_json()  # and written back without inventing what the old file lacked
    assert "tokens_softmasked" not in written["data"] and "beyond" not in written["ablation"]["cuts"][0]
    assert typed.ablation.cuts[0].beyond is None and typed.ablation.cuts[0].gain is None
    assert typed.results == EvalReport.from_json(data).results
