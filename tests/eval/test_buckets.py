"""Context buckets are exact (hand-computed cases); the bootstrap is seeded and paired."""

import numpy as np
import pytest

from genome_lm.errors import GenomeLMError
from genome_lm.eval.buckets import (
    WindowSums,
    bootstrap_units,
    bucket_of,
    change_interval,
    default_edges,
    mean_interval,
    parse_edges,
    resample_weights,
)

K = 1024


@pytest.mark.parametrize("window,edges", [
    (512 * K, [0] + [K << i for i in range(9)] + [512 * K]),  # [0,1k) [1k,2k) ... [256k,512k)
    (1 << 20, [0] + [K << i for i in range(10)] + [1 << 20]),  # ... [512k, 1M)
    (3000, [0, 1024, 2048, 3000]),
    (2048, [0, 1024, 2048]),
    (1000, [0, 64, 128, 256, 512, 1000]),  # short windows start at window / 8 rounded down to 2^k
])
def test_default_edges(window, edges):
    assert default_edges(window) == edges


@pytest.mark.parametrize("text,window,edges", [
    ("0,1k,4k", 32 * K, [0, 1024, 4096, 32 * K]),
    ("0,100,32k", 32 * K, [0, 100, 32 * K]),
    ("pow2:8k", 32 * K, [0, 8192, 16384, 32 * K]),
    ("pow2:1k", 3000, [0, 1024, 2048, 3000]),
])
def test_parse_edges(text, window, edges):
    assert parse_edges(text, window) == edges


@pytest.mark.parametrize("text", ["1k,2k", "0,4k,2k", "pow2:3k", "0,abc", ""])
def test_bad_edges_are_one_line_errors(text):
    with pytest.raises(GenomeLMError, match="--buckets"):
        parse_edges(text, 32 * K)


def test_bucket_of_hand_computed():
    edges = [0, 4, 8, 10]
    context = np.array([1, 3, 4, 7, 8, 9, 10, 0])
    assert bucket_of(context, edges).tolist() == [0, 0, 1, 1, 2, 2, -1, 0]


def test_window_sums_and_means_hand_computed():
    # window 0: bucket 0 gets 1, 3; bucket 1 gets 5.   window 1: bucket 0 gets 2.
    values = np.array([1.0, 3.0, 5.0, 2.0, 100.0])
    window = np.array([0, 0, 0, 1, 1])
    group = np.array([0, 0, 1, 0, -1])  # the last token is outside every bucket
    ws = WindowSums.of(values, window, group, 2, 2)
    np.testing.assert_array_equal(ws.sums, [[4, 5], [2, 0]])
    np.testing.assert_array_equal(ws.counts, [[2, 1], [1, 0]])
    np.testing.assert_allclose(ws.means(), [2.0, 5.0])


def test_bootstrap_is_seeded_and_brackets_the_mean():
    rng = np.random.default_rng(0)
    values = rng.normal(2.0, 0.5, 3000)
    window = rng.integers(0, 30, 3000)
    ws = WindowSums.of(values, window, np.zeros(3000, dtype=np.int64), 30, 1)
    a = mean_interval(ws, resample_weights(30, 400, seed=1))
    b = mean_interval(ws, resample_weights(30, 400, seed=1))
    c = mean_interval(ws, resample_weights(30, 400, seed=2))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert a[1][0] != c[1][0]
    mean, lo, hi = a
    assert lo[0] < mean[0] < hi[0]
    # the interval of the mean of 30 windows of ~100 N(2, 0.5) tokens: width about 4 * 0.5 / sqrt(3000)
    assert 0.01 < hi[0] - lo[0] < 0.08
    draws = resample_weights(30, 400, seed=1)
    assert draws.shape == (400, 30) and (draws.sum(1) == 30).all()


def test_paired_change_interval():
    """Every window improves by exactly 10%: the change and both ends of its paired interval are
    -10%, however different the windows' losses are."""
    rng = np.random.default_rng(3)
    base = rng.uniform(1, 3, 500)
    window = rng.integers(0, 12, 500)
    group = np.zeros(500, dtype=np.int64)
    wb = WindowSums.of(base, window, group, 12, 1)
    wt = WindowSums.of(base * 0.9, window, group, 12, 1)
    change, lo, hi = change_interval(wb, wt, resample_weights(12, 200, seed=0))
    np.testing.assert_allclose([change[0], lo[0], hi[0]], [-0.1, -0.1, -0.1], atol=1e-12)
    # unpaired noise: a real spread, and the interval contains the point estimate
    wt = WindowSums.of(base * rng.uniform(0.8, 1.0, 500), window, group, 12, 1)
    change, lo, hi = change_interval(wb, wt, resample_weights(12, 200, seed=0))
    assert lo[0] < change[0] < hi[0] < 0


def _overlapping_split(rng, stride: int, length: int = 1000):
    """A split of windows on two chromosomes starting every ``stride`` bases (the last of each
    shorter), and scores of every base of every window: (windows, TokenScores)."""
    from types import SimpleNamespace

    from genome_lm.eval.score import TokenScores

    windows = []
    for chrom, offset, size in (("chr2", 5_000, 3_300), ("chr7", 0, 2_100)):
        for start in range(offset, offset + size - length // 2, stride):
            windows.append(SimpleNamespace(chrom=chrom, start=start, length=min(length, offset + size - start)))
    order = rng.permutation(len(windows))  # scores arrive in any window order
    window = np.concatenate([np.full(windows[i].length - 1, i) for i in order])
    context = np.concatenate([np.arange(1, windows[i].length) for i in order])
    scores = TokenScores(rng.gamma(2.0, 0.6, window.size), context, window, rng.random(window.size) < 0.3)
    return windows, scores


def test_bootstrap_units_are_windows_when_they_do_not_overlap():
    rng = np.random.default_rng(4)
    windows, scores = _overlapping_split(rng, stride=1000)
    unit, count, name = bootstrap_units(scores, windows)
    assert name == "window" and count == len(windows)
    np.testing.assert_array_equal(unit, np.unique(scores.window, return_inverse=True)[1])


@pytest.mark.parametrize("stride", [250, 400, 999])
def test_bootstrap_units_of_overlapping_windows_are_blocks_of_sequence(stride):
    """Against a per-token loop: a score's unit is its base's block (one window length long, from
    the chromosome's first scored base), whichever window scored it."""
    rng = np.random.default_rng(stride)
    windows, scores = _overlapping_split(rng, stride)
    unit, count, name = bootstrap_units(scores, windows)
    first = {c: min(w.start for w in windows if w.chrom == c) for c in ("chr2", "chr7")}
    keys = [(windows[w].chrom, (windows[w].start + c - first[windows[w].chrom]) // 1000)
            for w, c in zip(scores.window.tolist(), scores.context.tolist())]
    names = sorted(set(keys))
    assert name == "block of 1,000 bases" and count == len(names) >= 5
    assert unit.tolist() == [names.index(k) for k in keys]


def test_summaries_bootstrap_over_the_units_given():
    """report.summarize and ablation.summarize with blocks as units: the intervals are those of a
    bootstrap over the blocks, recomputed here by hand from the same resample counts; with the
    windows as units, the same as without ``units``."""
    from genome_lm.eval import ablation
    from genome_lm.eval.report import summarize
    from genome_lm.eval.score import TokenScores

    rng = np.random.default_rng(9)
    windows, scores = _overlapping_split(rng, stride=250)
    unit, count, _ = bootstrap_units(scores, windows)
    edges = [0, 100, 1000]
    results, _ = summarize({"model": scores}, edges, resamples=200, seed=5, units=(unit, count))
    draws = resample_weights(count, 200, seed=5)
    sums = np.array([scores.nll[unit == u].sum() for u in range(count)])
    tokens = np.array([(unit == u).sum() for u in range(count)])
    lo, hi = np.percentile(draws @ sums / (draws @ tokens), [2.5, 97.5])
    assert results["model"].all.nats_ci == pytest.approx((lo, hi), rel=1e-12)
    assert results["model"].all.nats == pytest.approx(scores.nll.mean(), rel=1e-12)
    plain_windows, plain = _overlapping_split(np.random.default_rng(9), stride=1000)
    by_window = bootstrap_units(plain, plain_windows)
    assert summarize({"model": plain}, edges, resamples=50, seed=1, units=by_window[:2]) == \
        summarize({"model": plain}, edges, resamples=50, seed=1)
    cut = TokenScores(scores.nll + 0.01 * (scores.context >= 100), scores.context, scores.window, scores.softmasked)
    (entry,) = ablation.summarize(scores, {100: cut}, edges, resamples=200, seed=5, units=(unit, count)).cuts
    cut_sums = np.array([cut.nll[unit == u].sum() for u in range(count)])
    lo, hi = np.percentile((draws @ cut_sums - draws @ sums) / (draws @ tokens), [2.5, 97.5])
    assert entry.all.ci == pytest.approx((lo, hi), rel=1e-9)
