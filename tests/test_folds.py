"""The k-fold study (``genome-lm demo --fasta --folds --region``): the folds' plan (every base
held out exactly once, guard bands respected), the study end to end at a tiny size, and an
interrupted study finished by running the command again."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.data.regions import Region
from genome_lm.errors import GenomeLMError
from genome_lm.folds import FoldsReport, plan_folds


@pytest.mark.parametrize("seed", range(20))
def test_every_base_is_held_out_once_and_training_keeps_its_distance(seed):
    rng = np.random.default_rng(seed)
    window = int(rng.integers(10, 200))
    k = int(rng.integers(2, 7))
    guard = int(rng.integers(0, 3 * window))
    start = int(rng.integers(0, 1000))
    length = int(rng.integers(k * window + 2 * guard + 2 * window, 40 * window))
    region = Region("chrX", start, start + length)
    try:
        plans = plan_folds(region, k, window, guard)
    except GenomeLMError as exc:  # only when a fold leaves no training window
        assert "no training window" in str(exc)
        return
    held = np.zeros(length, dtype=int)
    for plan in plans:
        held[plan.held_out.start - start: plan.held_out.end - start] += 1
        assert plan.held_out.end - plan.held_out.start >= window
        for part in plan.train:
            assert part.name == "chrX" and start <= part.start < part.end <= start + length
            assert part.end - part.start >= window
            gap = max(plan.held_out.start - part.end, part.start - plan.held_out.end)
            assert gap >= guard, (plan, part)  # no training base within the guard of a held-out one
        # what training leaves out is the fold, its guards, and pieces shorter than a window
        trained = sum(p.end - p.start for p in plan.train)
        assert trained >= length - (plan.held_out.end - plan.held_out.start) - 2 * guard - 2 * (window - 1)
    assert (held == 1).all()  # every base exactly once
    assert [p.held_out.start for p in plans] == sorted(p.held_out.start for p in plans)
    sizes = [p.held_out.end - p.held_out.start for p in plans]
    assert max(sizes) - min(sizes) <= 1


def test_impossible_plans_are_one_line_errors():
    with pytest.raises(GenomeLMError, match="at least 2 folds"):
        plan_folds(Region("c", 0, 1000), 1, 10)
    with pytest.raises(GenomeLMError, match="shorter than one window"):
        plan_folds(Region("c", 0, 1000), 4, 300)
    with pytest.raises(GenomeLMError, match="fold 2 leaves no training window"):
        plan_folds(Region("c", 0, 3000), 3, 400, guard=700)  # the middle fold's guards eat its neighbours


TINY = ["--window", "2k", "--quiet", "--set", "train.steps=2", "--set", "data.seq_len=512", "--set",
        "train.save_every=1"]


@pytest.fixture(scope="module")
def genome(tmp_path_factory):
    from genome_lm.data.demo_genome import write_demo_genome

    return write_demo_genome(tmp_path_factory.mktemp("folds") / "genome.fa", scale=0.02)


def _study(genome, out, extra=()):
    return CliRunner().invoke(app, ["demo", "--fasta", str(genome), "--folds", "2", "--region", "chr22:20,001-36,000",
                                    "--out", str(out), *TINY, *extra])


@pytest.fixture(scope="module")
def study(genome, tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    result = _study(genome, out)
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.mark.slow
@pytest.mark.xdist_group("folds")  # one worker runs the study for both
def test_the_study_holds_out_every_base_once(study):
    out, text = study
    report = FoldsReport.from_json(json.loads((out / "folds.json").read_text()))
    assert report.to_json() == json.loads((out / "folds.json").read_text())
    assert [f.held_out for f in report.folds] == ["chr22:20,001-28,000", "chr22:28,001-36,000"]
    assert [f.train for f in report.folds] == [["chr22:30,049-36,000"], ["chr22:20,001-25,952"]]  # 2k guards
    covered = []
    for fold in report.folds:
        manifest = json.loads((out / f"fold-{fold.index}" / "dataset" / "manifest.json").read_text())
        (held,) = manifest["splits"]["eval"]["chromosomes"]
        (trained,) = manifest["splits"]["train"]["chromosomes"]
        assert (held["start"], held["end"]) == {1: (20000, 28000), 2: (28000, 36000)}[fold.index]
        assert trained["requested"] == fold.train[0]
        assert min(abs(trained["start"] - held["end"]), abs(held["start"] - trained["end"])) >= 2048
        covered.append((held["start"], held["end"]))
        eval_json = json.loads((out / f"fold-{fold.index}" / "run" / "eval" / "eval.json").read_text())
        assert fold.results["model"].all.tokens == eval_json["data"]["tokens"]
    assert covered == [(20000, 28000), (28000, 36000)]
    pooled = report.pooled.results
    assert pooled["model"].all.tokens == sum(f.results["model"].all.tokens for f in report.folds)
    assert {"model", "baseline", "markov", "uniform"} <= set(pooled)
    (cut,) = report.pooled.ablation.cuts
    assert cut.max_context == 1024 and cut.gain is not None
    assert len(report.findings) == 6 and all(len(f.folds) == 2 for f in report.findings)
    flat = " ".join(text.split())
    assert "fold 1 of 2: held out chr22:20,001-28,000" in flat and "fold 2 of 2" in flat
    assert "the study in short" in flat and "held out once" in flat


@pytest.mark.slow
@pytest.mark.xdist_group("folds")
def test_an_interrupted_study_finishes_on_a_rerun(genome, study, tmp_path, monkeypatch):
    """Killed while fold 2 is being evaluated: nothing pooled is written; the rerun reads fold 1
    back (no training step, no window scored again), finishes fold 2 from its scored windows and
    pools the same figures as the uninterrupted study."""
    import genome_lm.eval.score as score_module

    real, calls = score_module.token_nll, []

    def dying(*args, **kwargs):
        calls.append(1)
        if (tmp_path / "fold-2" / "run" / "eval" / ".scores").exists() and len(calls) % 7 == 0:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(score_module, "token_nll", dying)
    result = _study(genome, tmp_path)
    assert result.exit_code != 0 and not (tmp_path / "folds.json").exists()
    kept = {p: p.stat().st_mtime_ns for p in (tmp_path / "fold-1").rglob("*") if p.is_file()
            and ("checkpoint" in p.parts[-2] or ".scores" in p.parts)}
    assert kept
    monkeypatch.setattr(score_module, "token_nll", real)
    calls.clear()

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(score_module, "token_nll", counting)
    again = _study(genome, tmp_path)
    assert again.exit_code == 0, again.output
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # fold 1 read back, not redone
    whole = FoldsReport.from_json(json.loads((study[0] / "folds.json").read_text()))
    resumed = FoldsReport.from_json(json.loads((tmp_path / "folds.json").read_text()))
    assert resumed.pooled == whole.pooled and resumed.findings == whole.findings
    # a changed plan in the same folder is refused, not mixed in
    other = CliRunner().invoke(app, ["demo", "--fasta", str(genome), "--folds", "3", "--region", "chr22:20,001-36,000",
                                     "--out", str(tmp_path), *TINY])
    assert other.exit_code == 1 and "holds another k-fold study" in other.output


def test_bad_folds_arguments_are_one_line_errors(genome, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["demo", "--fasta", str(genome), "--folds", "2", "--out", str(tmp_path)])
    assert missing.exit_code == 1 and "missing --region" in missing.output
    both = runner.invoke(app, ["demo", "--fasta", str(genome), "--folds", "2", "--region", "chr22", "--train", "chr1",
                               "--out", str(tmp_path)])
    assert both.exit_code == 1 and "leave out --train and --eval" in both.output
    nowhere = runner.invoke(app, ["demo", "--fasta", str(genome), "--folds", "2", "--region", "chr9",
                                  "--out", str(tmp_path)])
    assert nowhere.exit_code == 1 and "no record 'chr9'" in nowhere.output
    too_many = runner.invoke(app, ["demo", "--fasta", str(genome), "--folds", "8", "--region", "chr22",
                                   "--out", str(tmp_path), "--window", "8k"])
    assert too_many.exit_code == 1 and "shorter than one window" in too_many.output
    assert not (tmp_path / "folds.json").exists()


@pytest.mark.slow
def test_the_copy_drill_mixes_into_training_but_not_into_the_baselines(genome, tmp_path):
    """--drill 0.3: the run trains on the genome and the drill (its loader state names the drill
    dataset), while the Markov chain is fitted on the genome's training bases only."""
    from genome_lm.checkpoint import latest_checkpoint
    from genome_lm.data.manifest import Manifest

    out = tmp_path / "dna"
    result = CliRunner().invoke(app, ["demo", "--fasta", str(genome), "--train", "chr22:28,001-36,000",
                                      "--eval", "chr22:20,001-26,000", "--drill", "0.3", "--out", str(out), *TINY])
    assert result.exit_code == 0, result.output
    state = json.loads((latest_checkpoint(out / "run") / "state-r00000.json").read_text())
    (mixed,) = state["loader"]["mix"]
    assert mixed[1:] == ["train", 0.3] and Manifest.load(out / "drill").split("train").windows
    config = json.loads((latest_checkpoint(out / "run") / "meta.json").read_text())["config"]
    assert config["data"]["mix"] == [{"dataset": str(out / "drill"), "split": "train", "fraction": 0.3}]
    report = json.loads((out / "run" / "eval" / "eval.json").read_text())
    genome_bases = sum(w.length for w in Manifest.load(out / "dataset").split("train").windows)
    assert f"fitted on {genome_bases:,} training bases" in report["models"]["markov"]["description"]
