"""Context buckets are exact (hand-computed cases); the bootstrap is seeded and paired."""

import numpy as np
import pytest

from genome_lm.errors import GenomeLMError
from genome_lm.eval.buckets import (WindowSums, bucket_of, change_interval, default_edges, mean_interval,
                                    parse_edges, resample_weights)

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
