"""The k-fold study (``genome-lm demo --fasta --folds --region``): the folds' plan (every base
held out exactly once, guard bands respected), the study end to end at a tiny size, and an
interrupted study finished by running the command again."""

from __future__ import annotations

import json
import shutil

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
    # the same folds with another recipe are refused too (issue 54, defect 7: they were mixed in)
    changed = _study(genome, tmp_path, ["--set", "train.lr=1e-3"])
    assert changed.exit_code == 1 and "holds another k-fold study (overrides differ" in changed.output
    # a plan from before the recipe was recorded: its folds are checked, and it gains the recipe
    path = tmp_path / "folds-plan.json"
    plan = json.loads(path.read_text())
    recipe = plan.pop("recipe")
    assert recipe["overrides"] == TINY[4::2] and recipe["config"] == "dna-finetune-cpu"
    path.write_text(json.dumps(plan))
    assert _study(genome, tmp_path).exit_code == 0
    assert json.loads(path.read_text())["recipe"] == recipe


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


# ----------------------------------------------------------------------------- genome-lm folds: one study or several

EDGES = [0, 50, 200, 301]
CUT = 50  # the context cut: the far-context gain is over the bases with 100+ of context


def _synthetic_study(rng, far_gain: list[float], overrides=()) -> tuple[FoldsReport, list[float]]:
    """A FoldsReport through the study's own summaries, from random scores whose far-context gain
    over the start is ``far_gain[k]`` in fold k (plus noise); also the gain each fold's scores
    give when computed by hand."""
    from genome_lm.eval import ablation, report
    from genome_lm.eval.evaluate import Scored
    from genome_lm.eval.pooled import pool
    from genome_lm.eval.schema import Bootstrap
    from genome_lm.eval.score import TokenScores
    from genome_lm.folds import FoldEntry, Pooled, findings, summary

    scored, entries, naive = [], [], []
    for k, gain in enumerate(far_gain):
        n_windows, length = 5 + k, 300  # uneven folds
        context = np.tile(np.arange(1, length + 1), n_windows)
        window = np.repeat(np.arange(n_windows), length)
        soft = rng.random(context.size) < 0.4
        far = context >= 2 * CUT

        def scores(nll):
            return TokenScores(nll, context, window, soft)

        model = rng.gamma(2.0, 0.6, context.size)
        base = model + 0.1 + rng.normal(0, 0.05, context.size)
        markov = model + 0.3 + rng.normal(0, 0.05, context.size)
        model_cut = model + (0.01 + gain) * far + rng.normal(0, 0.01, context.size)
        base_cut = base + 0.01 * far + rng.normal(0, 0.01, context.size)
        naive.append(float(((model_cut - model) - (base_cut - base))[far].mean()))
        fold = Scored({"model": scores(model), "baseline": scores(base), "markov": scores(markov)},
                      {"model": {CUT: scores(model_cut)}, "baseline": {CUT: scores(base_cut)}},
                      (window, n_windows), "window")
        results, comparison = report.summarize(fold.scores, EDGES, resamples=100, seed=1, units=fold.units)
        ablated = ablation.summarize(fold.scores["model"], fold.cuts["model"], EDGES, resamples=100, seed=1,
                                     units=fold.units, baseline=(fold.scores["baseline"], fold.cuts["baseline"]))
        scored.append(fold)
        entries.append(FoldEntry(index=k + 1, held_out=f"chrT:{1000 * k + 1}-{1000 * (k + 1)}", train=[],
                                 report="eval.json", units=n_windows, results=results, comparison=comparison,
                                 ablation=ablated))
    results, comparison, ablated = pool(scored, EDGES, resamples=100, seed=1)
    pooled = Pooled(units=[e.units for e in entries], results=results, comparison=comparison, ablation=ablated)
    study = FoldsReport(created="2026-12-07T00:00:00+00:00", genome_lm="0.1.0", fasta="t.fa", region="chrT",
                        k=len(far_gain), window=300, guard=300, config="dna-finetune-cpu", overrides=list(overrides),
                        bootstrap=Bootstrap(resamples=100, seed=1, level=0.95), edges=EDGES, folds=entries,
                        pooled=pooled, findings=findings(entries, pooled))
    study.summary = summary(study)
    return study, naive


def _write(study: FoldsReport, folder) -> None:
    folder.mkdir(parents=True)
    (folder / "folds.json").write_text(json.dumps(study.to_json(), allow_nan=False))


def test_folds_compares_the_recipes_of_studies_on_the_same_folds(tmp_path):
    from genome_lm.folds import compare_recipes, read_folds

    rng = np.random.default_rng(21)
    base, base_naive = _synthetic_study(rng, [0.05, 0.04, 0.06, 0.05])
    worse, worse_naive = _synthetic_study(rng, [0.05, -0.05, -0.04, 0.0], overrides=['train.lr_scale={"*": 0.5}'])
    _write(base, tmp_path / "base")
    _write(worse, tmp_path / "worse")
    rows = compare_recipes({"base": read_folds(tmp_path / "base"), "worse": read_folds(tmp_path / "worse")})
    for row, naive in zip(rows, (base_naive, worse_naive)):
        np.testing.assert_allclose([g.delta for g in row.gains], naive, rtol=1e-9, atol=1e-12)
        assert row.far == 2 * CUT and row.markov == ["holds"] * 4  # the chain is 0.3 nats worse everywhere
    assert rows[0].gain_holds == 4 and rows[1].gain_holds == 1
    assert rows[1].recipe == 'dna-finetune-cpu, window 300, train.lr_scale={"*": 0.5}'
    # the pooled gain is the base-weighted mean of the folds' gains
    far = [sum(CUT * 2 <= c < 301 for c in range(1, 301)) * (5 + k) for k in range(4)]
    assert rows[1].pooled_gain.delta == pytest.approx(np.average(worse_naive, weights=far), rel=1e-9)

    result = CliRunner().invoke(app, ["folds", str(tmp_path / "base"), str(tmp_path / "worse")],
                                env={"COLUMNS": "260"})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "│" in line and "dna-finetune-cpu" in line]
    assert len(lines) == 2 and "4 of 4 folds" in lines[0] and "1 of 4 folds" in lines[1]
    assert f"{rows[1].gains[1].delta:+.4f}" in lines[1] and "100+ of context" in result.output

    one = CliRunner().invoke(app, ["folds", str(tmp_path / "worse" / "folds.json")], env={"COLUMNS": "260"})
    assert one.exit_code == 0, one.output
    assert "holds in some folds (1 of 4; reversed in 2)" in one.output and "read " in one.output


def test_folds_refuses_what_it_cannot_compare(tmp_path):
    rng = np.random.default_rng(3)
    four, _ = _synthetic_study(rng, [0.05] * 4)
    three, _ = _synthetic_study(rng, [0.05] * 3)
    _write(four, tmp_path / "four")
    _write(three, tmp_path / "three")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "folds.json").write_text('{"schema": "genome-lm.folds/1", "k": ')
    data = four.to_json()
    data["folds"][0]["units"] = "many"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "folds.json").write_text(json.dumps(data))
    runner = CliRunner()
    for args, named in ([[tmp_path / "four", tmp_path / "three"], "holds out other folds"],
                        [[tmp_path / "nothing"], "no k-fold report here"],
                        [[tmp_path / "broken"], "not JSON"],
                        [[tmp_path / "bad"], "folds[0].units: expected an integer"]):
        result = runner.invoke(app, ["folds", *map(str, args)])
        lines = [x for x in result.output.splitlines() if x.strip()]
        assert result.exit_code == 1 and len(lines) == 1 and named in lines[0], result.output


def _on_disk(tmp_path, rng, studies: dict[str, float], k: int = 3, drops: dict[str, float] | None = None) -> dict:
    """Studies of the same k folds written as ``demo --folds`` leaves them, with random per-base
    scores in the score caches of the tuned models and of their start (the same in every study):
    study s's far-context value is ``studies[s]`` nats higher than its whole-window loss on bases
    with 2*CUT+ of context, and its tuned loss is its start's less ``drops[s]`` (default 0) plus
    noise. Returns {name: (folder, {fold: (whole, cut) nll per window})} and, under "start",
    {fold: {window: nll}}; a stale, incomplete cache sits beside one fold's."""
    from genome_lm.data.prepare import PrepareRequest, prepare
    from genome_lm.data.windows import WindowSpec
    from genome_lm.eval.cache import WindowCache

    fasta = tmp_path / "t.fa"
    seq = "".join(rng.choice(list("ACGTacgt"), 1200 * k))
    fasta.write_text(f">chrT\n{seq}\n>chrU\n{'ACGT' * 300}\n")
    dataset = tmp_path / "prepared"
    manifest = prepare(PrepareRequest(fasta, dataset, ("chrU",), ("chrT",), WindowSpec(300, 300, min_tail=1)),
                       workers=1, quiet=True).manifest
    windows = manifest.split("eval").windows
    start = {f: {w: rng.gamma(2.0, 0.6, 299).astype(np.float32).astype(np.float64) for w in range(len(windows))}
             for f in range(k)}
    out = {}
    for s, (name, far_gain) in enumerate(studies.items()):
        study, _ = _synthetic_study(rng, [0.01] * k)
        folder = tmp_path / name
        _write(study, folder)
        per_fold = {}
        for f in range(k):
            fold = folder / f"fold-{f + 1}"
            shutil.copytree(dataset, fold / "dataset")
            mine = [i for i, w in enumerate(windows) if 1200 * f <= w.start < 1200 * (f + 1)]
            (fold / "run" / "eval").mkdir(parents=True)
            data = {"dataset": str(fold / "dataset"), "split": "eval", "chrom": "chrT", "source": None,
                    "windows": mine, "window_length": 300, "tokens": 299 * len(mine)}
            (fold / "run" / "eval" / "eval.json").write_text(json.dumps({"data": data}))
            scores = fold / "run" / "eval" / ".scores"
            whole, cut = WindowCache(scores / f"model-{s:016x}"), WindowCache(scores / f"model-cut{CUT}-{s:016x}")
            per_fold[f] = {}
            for w in mine:  # the start's scores under another key in each study (another run's)
                WindowCache(scores / f"baseline-{s + 7:016x}").store(w, start[f][w])
                nll = np.abs(start[f][w] - (drops or {}).get(name, 0.0) + rng.normal(0, 0.05, 299))
                nll = nll.astype(np.float32).astype(np.float64)
                far = np.arange(1, 300) >= 2 * CUT
                nll_cut = (nll + far * far_gain + rng.normal(0, 0.01, 299)).astype(np.float32).astype(np.float64)
                whole.store(w, nll)
                cut.store(w, nll_cut)
                per_fold[f][w] = (nll, nll_cut)
            if f == 1:  # a model whose evaluation was interrupted: one window only
                WindowCache(scores / "model-00000000000000ff").store(mine[0], np.zeros(299))
                WindowCache(scores / f"model-cut{CUT}-00000000000000ff").store(mine[0], np.zeros(299))
        out[name] = (folder, per_fold)
    out["start"] = {f: {w: start[f][w] for w in per_fold[f]} for f in per_fold}
    return out


def test_paired_recipes_against_a_hand_computation(tmp_path):
    """--paired: the second study's tuned models against the first's on the same bases, pooled
    over the folds: the loss change and the extra far-context value equal their hand
    computation from the caches; the intervals are paired (the same study against itself: 0)."""
    from genome_lm.eval.cache import WindowCache
    from genome_lm.folds import pair_recipes, read_folds

    rng = np.random.default_rng(8)
    made = _on_disk(tmp_path, rng, {"base": 0.02, "drill": 0.05}, drops={"base": 0.10, "drill": 0.06})
    start = made.pop("start")
    studies = {name: (folder, read_folds(folder)) for name, (folder, _) in made.items()}
    pair, = pair_recipes(studies, resamples=200, seed=2)
    whole = {name: np.concatenate([nll for f in per_fold.values() for nll, _ in f.values()])
             for name, (_, per_fold) in made.items()}
    cut = {name: np.concatenate([c for f in per_fold.values() for _, c in f.values()])
           for name, (_, per_fold) in made.items()}
    far = np.tile(np.arange(1, 300) >= 2 * CUT, len(whole["base"]) // 299)
    assert pair.comparison.all.change == pytest.approx(whole["drill"].sum() / whole["base"].sum() - 1, rel=1e-9)
    want = ((cut["drill"] - whole["drill"]) - (cut["base"] - whole["base"]))[far].mean()
    assert pair.gain.all.delta == pytest.approx(want, rel=1e-9) and pair.far == 2 * CUT
    lo, hi = pair.gain.all.ci
    assert lo < want < hi and 0.02 < lo  # 0.03 nats more, clearly above zero

    # the share of base's loss drop from the start that drill keeps: about 0.06 / 0.10
    begin = np.concatenate([nll for f in start.values() for nll in f.values()])
    n = len(begin)
    want = (begin - whole["drill"]).sum() / (begin - whole["base"]).sum()
    kept = pair.kept["all"]
    assert kept.share == pytest.approx(want, rel=1e-9) and kept.tokens == n
    assert kept.first_drop == pytest.approx((begin - whole["base"]).mean(), rel=1e-9)
    assert kept.other_drop == pytest.approx((begin - whole["drill"]).mean(), rel=1e-9)
    assert kept.ci[0] < want < kept.ci[1] and 0.5 < kept.ci[0] and kept.ci[1] < 0.7
    far_want = (begin - whole["drill"])[far].sum() / (begin - whole["base"])[far].sum()
    assert pair.kept["far"].share == pytest.approx(far_want, rel=1e-9) and pair.kept["far"].tokens == far.sum()

    itself, = pair_recipes({"a": studies["base"], "b": studies["base"]}, resamples=50)
    assert itself.comparison.all.change == 0 and itself.gain.all.ci == (0.0, 0.0)
    assert itself.kept["all"].share == 1 and itself.kept["all"].ci == (1.0, 1.0)

    result = CliRunner().invoke(app, ["folds", str(tmp_path / "base"), str(tmp_path / "drill"), "--paired",
                                      "--resamples", "200"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"{pair.gain.all.delta:+.4f}" in result.output and "against" in result.output
    assert f"drill keeps {want:.0%} of {tmp_path / 'base'}'s drop" in result.output

    # a second complete cache in one fold: which model was evaluated is no longer clear
    spare = tmp_path / "drill" / "fold-1" / "run" / "eval" / ".scores"
    shutil.copytree(spare / f"model-{1:016x}", spare / "model-00000000000000aa")
    shutil.copytree(spare / f"model-cut{CUT}-{1:016x}", spare / f"model-cut{CUT}-00000000000000aa")
    with pytest.raises(GenomeLMError, match="2 tuned models with every window scored"):
        pair_recipes(studies, resamples=20)
    shutil.rmtree(spare / "model-00000000000000aa")

    # the studies started from other weights: no share of one's drop can be taken
    baseline = next(spare.glob("baseline-*"))
    window = int(next(baseline.glob("window-*.npy")).stem.split("-")[1])
    WindowCache(baseline).store(window, start[0][window] + 0.5)
    with pytest.raises(GenomeLMError, match="fold 1's starting models score its bases differently"):
        pair_recipes(studies, resamples=20)


def test_drop_share_needs_a_drop_to_share():
    """``drop_share``: the first study's drop not above zero (its interval reaching zero) gives no
    share; a clear drop gives the ratio of the pooled sums, inside its interval."""
    from genome_lm.eval.pooled import stratified_weights
    from genome_lm.folds import drop_share

    rng = np.random.default_rng(3)
    unit = np.repeat(np.arange(40), 50)
    weights = stratified_weights([40], 300, 0)
    start = rng.gamma(2.0, 0.6, unit.size)
    none = drop_share(start, start + rng.normal(0, 0.01, unit.size), start - 0.02, unit, weights)
    assert none.share is None and none.ci is None and none.first_drop_ci[0] <= 0 <= none.first_drop_ci[1]
    some = drop_share(start, start - 0.1, start - 0.03 + rng.normal(0, 0.01, unit.size), unit, weights)
    assert some.share == pytest.approx(0.3, abs=0.01) and some.ci[0] < some.share < some.ci[1]
