"""Pooling the folds of a k-fold study (``eval.pooled``): the pooled figures against a hand
computation with explicit loops, the stratified resampling, and one fold pooled alone being that
fold's own report."""

from __future__ import annotations

import numpy as np
import pytest

from genome_lm.eval import ablation, report
from genome_lm.eval.evaluate import Scored
from genome_lm.eval.pooled import pool, stratified_weights
from genome_lm.eval.score import TokenScores

EDGES = [0, 50, 200, 301]
N = 50  # the context cut: "beyond" is the bases with 100+ of context


def _fold(rng, n_windows, length=300, shift=0.0) -> Scored:
    """A fold's scores: model, baseline (worse by 0.1), each cut to N (the model's cut costs more
    far away), bootstrap units = windows; uneven window counts between folds."""
    context = np.tile(np.arange(1, length + 1), n_windows)
    window = np.repeat(np.arange(n_windows), length)
    soft = rng.random(context.size) < 0.4
    model = TokenScores(rng.gamma(2.0, 0.6, context.size) + shift, context, window, soft)
    base = TokenScores(model.nll + 0.1 + rng.normal(0, 0.05, context.size), context, window, soft)
    far = context >= 2 * N
    cuts = {"model": {N: TokenScores(model.nll + 0.03 * far + rng.normal(0, 0.01, context.size), context, window,
                                     soft)},
            "baseline": {N: TokenScores(base.nll + 0.01 * far, context, window, soft)}}
    return Scored({"model": model, "baseline": base}, cuts, (window, n_windows), "window")


def test_stratified_weights_draw_each_fold_within_itself():
    w = stratified_weights([3, 5, 1], resamples=200, seed=4)
    assert w.shape == (200, 9)
    assert (w[:, :3].sum(1) == 3).all() and (w[:, 3:8].sum(1) == 5).all() and (w[:, 8] == 1).all()
    assert np.array_equal(w, stratified_weights([3, 5, 1], resamples=200, seed=4))
    assert w[:, 3:8].std() > 0  # drawn, not fixed


def _naive_interval(folds, value_of, keep_of, resamples, seed, level=0.95):
    """The pooled mean of ``value_of(fold)`` over the bases ``keep_of(fold)`` and its stratified
    bootstrap interval, by explicit loops over folds, resamples and windows (the draws made as
    ``stratified_weights`` documents them: one generator, folds in order)."""
    rng = np.random.default_rng(seed)
    draws = [rng.multinomial(f.units[1], [1 / f.units[1]] * f.units[1], size=resamples) for f in folds]
    per_window = []
    for f in folds:
        values, keep, unit = value_of(f), keep_of(f), f.units[0]
        per_window.append([(float(values[keep & (unit == u)].sum()), int((keep & (unit == u)).sum()))
                           for u in range(f.units[1])])
    total = sum(s for fold in per_window for s, _ in fold)
    count = sum(c for fold in per_window for _, c in fold)
    means = []
    for r in range(resamples):
        s = c = 0.0
        for k, fold in enumerate(per_window):
            for u, (su, cu) in enumerate(fold):
                s += draws[k][r, u] * su
                c += draws[k][r, u] * cu
        means.append(s / c)
    lo, hi = np.percentile(means, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return total / count, lo, hi


def test_pooled_figures_against_a_hand_computation():
    rng = np.random.default_rng(7)
    folds = [_fold(rng, 3), _fold(rng, 5, shift=0.2)]
    results, comparison, ablated = pool(folds, EDGES, resamples=300, seed=11)
    everything = lambda f: np.ones(f.scores["model"].nll.size, dtype=bool)  # noqa: E731
    mean, lo, hi = _naive_interval(folds, lambda f: f.scores["model"].nll, everything, 300, 11)
    assert results["model"].all.nats == pytest.approx(mean, rel=1e-12)
    assert results["model"].all.nats_ci == pytest.approx((lo, hi), rel=1e-9)
    in_bucket = lambda f: (f.scores["model"].context >= 50) & (f.scores["model"].context < 200)  # noqa: E731
    mean, lo, hi = _naive_interval(folds, lambda f: f.scores["baseline"].nll, in_bucket, 300, 11)
    assert results["baseline"].buckets[1].nats == pytest.approx(mean, rel=1e-12)
    assert results["baseline"].buckets[1].nats_ci == pytest.approx((lo, hi), rel=1e-9)
    # the gain beyond 2N on repeats: (model cut - model) - (baseline cut - baseline), base by base
    far_soft = lambda f: (f.scores["model"].context >= 2 * N) & f.scores["model"].softmasked  # noqa: E731

    def gain(f):
        return ((f.cuts["model"][N].nll - f.scores["model"].nll)
                - (f.cuts["baseline"][N].nll - f.scores["baseline"].nll))

    mean, lo, hi = _naive_interval(folds, gain, far_soft, 300, 11)
    (cut,) = ablated.cuts
    assert cut.gain.beyond.softmasked.delta == pytest.approx(mean, rel=1e-9)
    assert cut.gain.beyond.softmasked.ci == pytest.approx((lo, hi), rel=1e-9)
    assert cut.gain.beyond.softmasked.ci[0] > 0.01  # 0.03 - 0.01 planted, the noise is small
    assert comparison.all.ci[1] < 0  # the model is below its baseline in every fold
    tokens = sum(f.scores["model"].nll.size for f in folds)
    assert results["model"].all.tokens == tokens and cut.beyond.all.tokens == sum(
        int((f.scores["model"].context >= 2 * N).sum()) for f in folds)


def test_one_fold_pooled_is_its_own_report():
    fold = _fold(np.random.default_rng(3), 6)
    results, comparison, ablated = pool([fold], EDGES, resamples=200, seed=5)
    own_results, own_comparison = report.summarize(fold.scores, EDGES, resamples=200, seed=5, units=fold.units)
    own_ablation = ablation.summarize(fold.scores["model"], fold.cuts["model"], EDGES, resamples=200, seed=5,
                                      units=fold.units, baseline=(fold.scores["baseline"], fold.cuts["baseline"]))
    assert (results, comparison, ablated) == (own_results, own_comparison, own_ablation)


def test_folds_scored_on_different_models_are_refused():
    rng = np.random.default_rng(0)
    one, two = _fold(rng, 3), _fold(rng, 3)
    del two.scores["baseline"]
    with pytest.raises(ValueError, match="fold 2"):
        pool([one, two], EDGES, resamples=10)
