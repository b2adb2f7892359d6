"""Ranking metrics for variant scores, with bootstrap intervals.

A higher score means "more likely positive" (e.g. pathogenic): a model's log-likelihood ratio
(alt minus ref) is lower for damaging variants, so pass its negation.

Every metric takes ``weights``: how many times each variant counts, one row per bootstrap
resample. A resample drawn with replacement is the original variants with integer counts, and
copies of a variant share its score, so the metric of the resample equals the weighted metric
of the original. That lets 1,000 resamples run as a few array operations over the distinct
scores instead of 1,000 sorts.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# metric(scores, labels, weights=None): a float, or with weights [B, n] an array [B]
Metric = Callable[..., "float | np.ndarray"]

_CELLS_PER_CHUNK = 1 << 20  # resamples are processed in blocks of about this many (resample, variant) cells


def _checked(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels)
    if s.ndim != 1 or y.shape != s.shape:
        raise ValueError(f"scores and labels must be 1-D and of one length (got shapes {s.shape} and {y.shape})")
    if nan := int(np.isnan(s).sum()):
        raise ValueError(f"{nan} of {s.size} scores are NaN; every variant needs a score")
    if not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0 or 1 (or bool)")
    y = y.astype(bool)
    if y.all() or not y.any():
        raise ValueError(f"labels need both classes (got {int(y.sum())} positives of {y.size})")
    return s, y


def _class_weights(s: np.ndarray, y: np.ndarray, weights) -> tuple[np.ndarray, np.ndarray]:
    """Positive and negative weight of each distinct score, in ascending score order: [B, G] each."""
    w = np.ones((1, s.size)) if weights is None else np.atleast_2d(np.asarray(weights, dtype=float))
    if w.shape[1] != s.size:
        raise ValueError(f"weights have {w.shape[1]} columns for {s.size} scores")
    order = np.argsort(s, kind="stable")
    ordered = s[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    w, y = w[:, order], y[order]
    pos = np.add.reduceat(np.where(y, w, 0.0), starts, axis=1)
    neg = np.add.reduceat(np.where(y, 0.0, w), starts, axis=1)
    return pos, neg


def _result(values: np.ndarray, weights) -> float | np.ndarray:
    return float(values[0]) if weights is None else values


def auroc(scores, labels, weights=None) -> float | np.ndarray:
    """Area under the ROC curve: the chance that a random positive scores above a random
    negative, ties counting one half (Mann-Whitney U with average ranks)."""
    s, y = _checked(scores, labels)
    pos, neg = _class_weights(s, y, weights)
    below = np.cumsum(neg, axis=1) - neg  # negative weight strictly below each score
    values = (pos * (below + 0.5 * neg)).sum(axis=1) / (pos.sum(axis=1) * neg.sum(axis=1))
    return _result(values, weights)


def auprc(scores, labels, weights=None) -> float | np.ndarray:
    """Average precision as scikit-learn's ``average_precision_score`` defines it: the sum over
    distinct score thresholds, highest first, of precision times the recall gained there (tied
    scores enter together, no interpolation)."""
    s, y = _checked(scores, labels)
    pos, neg = _class_weights(s, y, weights)
    pos, neg = pos[:, ::-1], neg[:, ::-1]  # highest score first
    tp, fp = np.cumsum(pos, axis=1), np.cumsum(neg, axis=1)
    called = tp + fp
    precision = np.divide(tp, called, out=np.zeros_like(tp), where=called > 0)  # 0/0 only where no recall is gained
    values = (precision * pos).sum(axis=1) / tp[:, -1]
    return _result(values, weights)


def _resample_counts(y: np.ndarray, resamples: int, rng: np.random.Generator):
    """Blocks of [b, n] counts: how often each variant is drawn in each resample, positives and
    negatives drawn separately (as many of each as there are), so every resample has both."""
    groups = [np.flatnonzero(y), np.flatnonzero(~y)]
    n = y.size
    block = max(1, _CELLS_PER_CHUNK // n)
    for first in range(0, resamples, block):
        b = min(block, resamples - first)
        drawn = np.concatenate([g[rng.integers(0, g.size, size=(b, g.size))] for g in groups], axis=1)
        drawn += (np.arange(b) * n)[:, None]
        yield np.bincount(drawn.ravel(), minlength=b * n).reshape(b, n).astype(float)


def _interval(values: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap(scores, labels, metric: Metric, resamples: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(metric, 2.5th percentile, 97.5th percentile) over ``resamples`` resamples of the
    variants, drawn with replacement within each class so that class sizes stay as they are."""
    s, y = _checked(scores, labels)
    rng = np.random.default_rng(seed)
    values = np.concatenate([metric(s, y, weights=w) for w in _resample_counts(y, resamples, rng)])
    return (float(metric(s, y)), *_interval(values))


def paired_difference(
    scores_a, scores_b, labels, metric: Metric, resamples: int = 1000, seed: int = 0
) -> tuple[float, float, float]:
    """(metric(a) - metric(b), 95% percentile interval), both scored on the same resamples, so
    that what the two have in common (which variants were drawn) cancels out of the interval."""
    a, y = _checked(scores_a, labels)
    b, _ = _checked(scores_b, labels)
    rng = np.random.default_rng(seed)
    values = np.concatenate(
        [metric(a, y, weights=w) - metric(b, y, weights=w) for w in _resample_counts(y, resamples, rng)]
    )
    return (float(metric(a, y) - metric(b, y)), *_interval(values))
