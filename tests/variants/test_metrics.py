"""AUROC / AUPRC against scikit-learn, and the bootstrap's weighted shortcut against real resamples."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

from genome_lm.variants.metrics import auprc, auroc, bootstrap, paired_difference


def sample(rng: np.random.Generator, n: int, positive_rate: float, signal: float = 1.0):
    """Labels with uneven classes and scores that separate them somewhat, rounded so many tie."""
    labels = rng.random(n) < positive_rate
    labels[:2] = (True, False)  # both classes, always
    scores = np.round(rng.normal(size=n) + signal * labels, 1)
    return scores, labels


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_scikit_learn(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 2000))
    scores, labels = sample(rng, n, positive_rate=float(rng.uniform(0.03, 0.6)))
    assert len(np.unique(scores)) < n  # ties present
    assert auroc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert auprc(scores, labels) == pytest.approx(average_precision_score(labels, scores), abs=1e-12)
    assert auroc(scores, labels.astype(int)) == auroc(scores, labels)


def test_hand_counted():
    # positives 0.35 and 0.8 against negatives 0.1 and 0.4: 3 of 4 pairs ordered right
    scores, labels = [0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]
    assert auroc(scores, labels) == 0.75
    # thresholds 0.8 (precision 1, recall 1/2), 0.4 (1/2, 1/2), 0.35 (2/3, 1): 1/2 * 1 + 1/2 * 2/3
    assert auprc(scores, labels) == pytest.approx(5 / 6)
    # a tie between a positive and a negative counts one half, and enters the precision together
    assert auroc([1, 1, 0], [1, 0, 0]) == 0.75
    assert auprc([1, 1, 0], [1, 0, 0]) == 0.5


def test_weights_are_resamples():
    """A weighted metric equals the metric of the data with each variant repeated that often."""
    rng = np.random.default_rng(11)
    scores, labels = sample(rng, 300, positive_rate=0.2)
    counts = rng.multinomial(300, np.full(300, 1 / 300), size=4)
    counts[:, :2] += 1  # keep both classes in every row
    for metric, oracle in ((auroc, roc_auc_score), (auprc, average_precision_score)):
        weighted = metric(scores, labels, weights=counts)
        expected = [oracle(np.repeat(labels, c), np.repeat(scores, c)) for c in counts]
        np.testing.assert_allclose(weighted, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("metric", [auroc, auprc])
def test_bootstrap_interval_contains_the_value_and_narrows_with_more_data(metric):
    rng = np.random.default_rng(3)
    widths = []
    for n in (200, 5000):
        scores, labels = sample(rng, n, positive_rate=0.2)
        value, lo, hi = bootstrap(scores, labels, metric, resamples=500, seed=1)
        assert value == metric(scores, labels)
        assert lo < value < hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # about sqrt(25) = 5 times narrower
    assert bootstrap(scores, labels, metric, resamples=500, seed=1) == (value, lo, hi)  # reproducible


def test_bootstrap_keeps_both_classes_in_every_resample():
    rng = np.random.default_rng(4)
    scores = rng.normal(size=400)
    labels = np.zeros(400, dtype=bool)
    labels[7] = True  # a single positive: every resample must still draw it
    value, lo, hi = bootstrap(scores, labels, auroc, resamples=200)
    assert np.isfinite([value, lo, hi]).all()


def test_paired_difference():
    rng = np.random.default_rng(5)
    scores, labels = sample(rng, 1000, positive_rate=0.3, signal=1.5)
    assert paired_difference(scores, scores, labels, auroc) == (0.0, 0.0, 0.0)
    noise = rng.normal(size=1000)
    diff, lo, hi = paired_difference(scores, noise, labels, auroc, resamples=300)
    assert diff == pytest.approx(auroc(scores, labels) - auroc(noise, labels))
    assert 0 < lo < diff < hi


def test_thousand_resamples_of_four_thousand_variants_are_quick():
    import time

    scores, labels = sample(np.random.default_rng(6), 4000, positive_rate=0.2)
    began = time.perf_counter()
    bootstrap(scores, labels, auroc)
    paired_difference(scores, -scores, labels, auprc)
    assert time.perf_counter() - began < 10  # about 0.5 s on 2 busy cores; generous against load


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="1 of 3 scores are NaN"):
        auroc([0.1, np.nan, 0.3], [0, 1, 1])
    with pytest.raises(ValueError, match="1 of 3 scores are NaN"):
        bootstrap([0.1, np.nan, 0.3], [0, 1, 1], auprc)
    with pytest.raises(ValueError, match="1 of 3 scores are NaN"):
        paired_difference([0.1, 0.2, 0.3], [0.1, np.nan, 0.3], [0, 1, 1], auroc)
    with pytest.raises(ValueError, match="both classes"):
        auprc([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError, match="0 or 1"):
        auroc([0.1, 0.2], [0, 2])
    with pytest.raises(ValueError, match="one length"):
        auroc([0.1, 0.2, 0.3], [0, 1])


def test_a_compare_column_missing_on_one_class_is_not_compared_instead_of_a_crash():
    """The review's case (issue 54, defect 1): 3 LOF variants without a CADD value and 3 FUNC ones
    with it. The paired AUROC difference of the model against CADD would be over FUNC variants
    only: it is left out and said so, and the rest of the metrics are still given."""
    from types import SimpleNamespace

    from genome_lm.variants.report import metrics, summary

    labels = np.array([1, 1, 1, 0, 0, 0])
    scores = {"model@4096": {"sum": np.array([-3.0, -2.5, -2.0, 0.1, 0.2, -0.1]), "mean": np.zeros(6)},
              "markov": {"sum": np.array([-1.0, 0.5, -0.2, 0.3, -0.4, 0.0]), "mean": np.zeros(6)}}
    compare = {"CADD": np.array([np.nan, np.nan, np.nan, 12.0, 20.0, 5.0])}
    variants = [SimpleNamespace(info={"CONSEQUENCE": "Missense"}) for _ in range(6)]
    req = SimpleNamespace(score="sum", resamples=50, seed=0, contexts=[4096], label="FUNC_CLASS", positive=("LOF",),
                          negative=None)
    m = metrics(scores, compare, labels, variants, req)
    assert [(d.a, d.b) for d in m.differences] == [("model@4096", "markov")]
    assert m.not_compared == ["model@4096 vs CADD: the 3 variants both scored are all negative"]
    assert set(m.overall) == {"model@4096", "markov"}  # CADD alone has one class too: no AUROC of its own
    report = SimpleNamespace(data=SimpleNamespace(variants=6, skipped=0, positives=3, negatives=3), metrics=m)
    assert "not compared: model@4096 vs CADD: the 3 variants both scored are all negative" in summary(report)
