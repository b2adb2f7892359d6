"""The demo's closing lines (``eval.verdict``) say what the report measured, with its sign.

The fixture is the eval.json of a real ``genome-lm demo`` run (2026-12-07, 2 cores): the tuned
model's loss fell 0.98% against its start, but most at 1-2k bases of context; the order-8 Markov
chain is 3.7% better; fine-tuning lowered the planted-copy advantage. Variants of it, with the
figures moved, check each other way a line can point.
"""

import copy
import json
from pathlib import Path

import pytest

from genome_lm.eval.schema import EvalReport
from genome_lm.eval.verdict import demo_verdict, far_context_lines, markov_line, planted_line, seed_finding

DEMO = json.loads((Path(__file__).parent / "data" / "demo_eval.json").read_text())


def _report(edit=None) -> EvalReport:
    doc = copy.deepcopy(DEMO)
    if edit:
        edit(doc)
    return EvalReport.from_json(doc)


def test_the_demo_that_loses_to_the_chain_and_to_its_start_says_so():
    lines = demo_verdict(_report())
    text = "\n".join(lines)
    assert lines[0].startswith("The seed's finding is not reproduced here")
    assert "-0.98% [-1.21%, -0.70%]" in lines[0] and "most at 1,024-2,047" in lines[0]
    assert "not at the longest (16,384-32,767: -0.68%" in lines[0]
    assert "the chain is 3.67% better: the tuned model does not beat it" in text
    assert "1.9019 [1.8941, 1.9101] vs 1.8346 bits/base" in text
    planted = next(line for line in lines if line.startswith("Planted copies"))
    assert "+0.0766 [+0.0198, +0.1420]" in planted and "its start's was +0.1413 [+0.0323, +0.2865]" in planted
    assert "fine-tuning lowered it, -0.0647" in planted
    assert "long context helps" not in text and "beats it" not in text


def test_the_far_context_line_names_both_models_and_the_difference():
    (line,) = far_context_lines(_report())
    assert line.startswith("The context beyond 256 bases: used")
    assert "+0.0087 [+0.0044, +0.0128]" in line and "its start +0.0029" in line
    assert "worth more to it than to its start: +0.0058 [+0.0018, +0.0099]" in line

    def no_difference(doc):
        doc["ablation"]["cuts"][0]["gain"]["all"]["ci"] = [-0.001, 0.002]

    assert "as much as to its start (no measurable difference)" in far_context_lines(_report(no_difference))[0]

    def unused(doc):
        doc["ablation"]["cuts"][0]["all"]["ci"] = [-0.001, 0.002]

    assert far_context_lines(_report(unused))[0].startswith("The context beyond 256 bases: not measurably used")


def _wins(doc):
    """The model below the chain and the fall largest in the longest bucket."""
    doc["results"]["markov"]["all"]["bits"] = 1.95
    for i, b in enumerate(doc["comparison"]["buckets"]):
        if b["change"] is not None:
            b["change"], b["ci"] = -0.001 * (i + 1), [-0.001 * (i + 2), -0.001 * i]


def test_a_report_that_shows_the_finding_says_it_holds():
    report = _report(_wins)
    assert seed_finding(report).startswith("The seed's finding holds here")
    assert "most at the longest context measured (16,384-32,767 bases" in seed_finding(report)
    assert "the tuned model beats it, 2.47% lower" in markov_line(report)


@pytest.mark.parametrize("ci, words", [([0.001, 0.004], "loss rose"), ([-0.002, 0.003], "did not measurably change")])
def test_a_loss_that_did_not_fall(ci, words):
    def edit(doc):
        doc["comparison"]["all"]["ci"] = ci
        doc["comparison"]["all"]["change"] = sum(ci) / 2

    line = seed_finding(_report(edit))
    assert line.startswith("The seed's finding is not reproduced here") and words in line


def test_level_with_the_chain_and_a_copy_advantage_fine_tuning_did_not_move():
    def edit(doc):
        doc["results"]["markov"]["all"]["bits"] = 1.90
        doc["planted"]["models"]["model"]["change_vs_baseline"]["ci"] = [-0.02, 0.01]

    report = _report(edit)
    assert "level with it" in markov_line(report)
    assert "fine-tuning changed it by no measurable amount" in planted_line(report)


def test_without_starting_weights_no_seed_line():
    """``demo --long`` evaluates without --baseline: no comparison, no line about the start."""

    def edit(doc):
        doc["comparison"] = None
        for name in ("baseline",):
            doc["results"].pop(name)
            doc["models"].pop(name)
            doc["planted"]["models"].pop(name)
        doc["planted"]["models"]["model"].pop("change_vs_baseline")
        for cut in doc["ablation"]["cuts"]:
            cut.pop("gain")
            cut.pop("baseline")

    lines = demo_verdict(_report(edit))
    assert seed_finding(_report(edit)) is None
    assert lines[0].startswith("Against an order-8 Markov chain")
    assert lines[1] == ("The context beyond 256 bases: used (cutting it costs the tuned model +0.0087 "
                        "[+0.0044, +0.0128] nats/base).")
    assert lines[2].endswith("(it uses a first copy in the window).")
