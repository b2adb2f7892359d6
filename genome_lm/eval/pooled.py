"""One report over the folds of a k-fold study: every held-out base once, intervals stratified by fold.

Each fold of ``genome-lm demo --folds`` holds out its own stretch of sequence and scores it with
its own tuned model, its starting weights and the Markov chain fitted on its training folds
(``eval.evaluate.Scored``). Pooled, every base of the region is scored once, by the models that
never saw it in training:

- the pooled mean of a group (a subset, a context bucket, the bases beyond 2N) is the sum of the
  losses of its bases over all folds divided by their number, as if one evaluation had scored
  them all;
- the interval is a stratified bootstrap: each resample draws, inside every fold, as many of
  that fold's units (blocks of sequence, ``buckets.bootstrap_units``) as it has, with
  replacement, and takes the pooled mean of what was drawn. Folds are strata: a resample never
  trades one fold's bases for another's, so the interval reflects the variation within the
  folds, and the pooled figure is weighted by each fold's size, as the study is;
- differences (tuned minus start, the context cut, the gain over the start) are paired: the same
  resample for both sides.

The per-fold sums are those of ``report`` and ``ablation`` and the intervals come from the same
functions, with the stratified resample weights (``stratified_weights``) in place of a single
evaluation's.
"""

from __future__ import annotations

import numpy as np

from . import ablation as abl
from . import report as rep
from .buckets import WindowSums, subset_and_bucket_sums
from .schema import Ablation, Comparison, ModelResult


def stratified_weights(units: list[int], resamples: int, seed: int) -> np.ndarray:
    """[R, sum(units)]: in each resample, how often each unit is drawn, fold by fold (fold f's
    ``units[f]`` units, drawn ``units[f]`` times with replacement, multinomial, one seeded
    generator drawing the folds in order)."""
    rng = np.random.default_rng(seed)
    parts = [rng.multinomial(n, np.full(n, 1.0 / n), size=resamples) if n else np.zeros((resamples, 0))
             for n in units]
    return np.concatenate(parts, axis=1).astype(np.float64)


def _concat(parts: list[WindowSums]) -> WindowSums:
    return WindowSums(np.concatenate([p.sums for p in parts]), np.concatenate([p.counts for p in parts]))


def pool(folds: list, edges: list[int], *, resamples: int = 1000, seed: int = 0, level: float = 0.95
         ) -> tuple[dict[str, ModelResult], Comparison | None, Ablation | None]:
    """(results, comparison, ablation) over ``folds`` (each an ``eval.evaluate.Scored``, with the
    same models and cuts), as the module docstring says."""
    names = list(folds[0].scores)
    per_fold = []
    for k, fold in enumerate(folds):
        if list(fold.scores) != names or any(not fold.scores[names[0]].same_tokens(s) for s in fold.scores.values()):
            raise ValueError(f"fold {k + 1}: its models are not those of fold 1, or not scored on the same bases")
        unit, n_units = fold.units
        per_fold.append({name: subset_and_bucket_sums(fold.scores[name], unit, n_units, edges) for name in names})
    weights = stratified_weights([fold.units[1] for fold in folds], resamples, seed)
    sums = {name: tuple(_concat([f[name][part] for f in per_fold]) for part in (0, 1)) for name in names}
    results, comparison = rep.summarize_sums(sums, edges, weights, level)
    cuts = sorted(folds[0].cuts.get("model", {}))
    if not cuts:
        return results, comparison, None
    with_baseline = "baseline" in folds[0].cuts
    pooled_cuts = {}
    for N in cuts:
        model_parts, base_parts = [], []
        for fold in folds:
            unit, n_units = fold.units
            model_parts.append(abl.cut_sums(fold.scores["model"], fold.cuts["model"][N], N, edges, unit, n_units))
            if with_baseline:
                base_parts.append(abl.cut_sums(fold.scores["baseline"], fold.cuts["baseline"][N], N, edges, unit,
                                               n_units, fold.scores["model"]))
        pooled_cuts[N] = tuple(None if not parts else [tuple(_concat([p[i][side] for p in parts]) for side in (0, 1))
                                                       for i in range(len(parts[0]))]
                               for parts in (model_parts, base_parts))
    return results, comparison, abl.summarize_sums(pooled_cuts, edges, weights, level)
