"""The context ablation's scoring and summary (``eval --max-context``): exactness by definition
(a cut beyond the window is the whole-window score; a cut of N is each N-input segment scored
alone) and the per-bucket differences with their intervals. The command is in
test_ablation_cli.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from genome_lm.eval.ablation import fmt_delta, summarize
from genome_lm.eval.schema import Ablation, Stat
from genome_lm.eval.score import TokenScores, token_nll, token_nll_cut


@pytest.fixture(scope="module")
def tiny_model():
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.model import build_model
    from genome_lm.model.presets import get_preset

    with parallel_context() as pg:
        torch.manual_seed(0)
        model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()
        yield model


def test_a_cut_beyond_the_window_is_the_whole_window_score(tiny_model):
    tokens = np.random.default_rng(0).integers(0, 4, 301)
    whole = token_nll(tiny_model, tokens)
    for N in (300, 301, 5000):
        assert np.array_equal(token_nll_cut(tiny_model, tokens, N), whole)


@pytest.mark.slow
@pytest.mark.parametrize("N,chunk", [(1, None), (64, None), (97, None), (64, 130), (40, 39)])
def test_a_cut_of_n_is_each_segment_scored_alone(tiny_model, N, chunk):
    """Independently: every target j (1-based position in the window) predicted by a forward over
    tokens[start .. j-1] alone, start = the last multiple of N below j; targets grouped by that.
    The segments run batched (all in one forward, or ``chunk // N`` per forward, at least one);
    each here runs alone."""
    tokens = np.random.default_rng(1).integers(0, 4, 260)  # 259 targets: not a multiple of N
    forwards = []
    hook = tiny_model.register_forward_hook(lambda m, args, out: forwards.append(tuple(args[0].shape)))
    try:
        got = token_nll_cut(tiny_model, tokens, N, chunk=chunk)
    finally:
        hook.remove()
    per_forward = 259 // N if chunk is None else max(1, chunk // N)
    assert forwards[0] == (min(per_forward, 259 // N), N)  # whole segments as the rows of a batch
    assert got.shape == (259,)
    want = np.empty(259)
    for start in range(0, 259, N):
        seg = torch.from_numpy(tokens[start:start + N + 1])[None]
        with torch.no_grad():
            logits = tiny_model(seg[:, :-1]).logits[0].float()
        want[start:start + seg.shape[1] - 1] = torch.nn.functional.cross_entropy(
            logits, seg[0, 1:], reduction="none").double().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # the first segment is the whole window's prefix: identical targets, identical scores
    whole = token_nll(tiny_model, tokens)
    np.testing.assert_allclose(got[:N], whole[:N], rtol=1e-5, atol=1e-6)


def test_summary_differences_and_intervals():
    """Per bucket, loss(cut) - loss(whole) with a paired interval that holds the true shift."""
    rng = np.random.default_rng(3)
    n, windows = 4000, 8
    context = np.tile(np.arange(1, n // windows + 1), windows)
    window = np.repeat(np.arange(windows), n // windows)
    whole = TokenScores(rng.gamma(2.0, 0.6, n), context, window, rng.random(n) < 0.3)
    shift = np.where(context >= 256, 0.05, 0.0)
    cut = TokenScores(whole.nll + shift + rng.normal(0, 0.01, n), context, window, whole.softmasked)
    out = summarize(whole, {256: cut}, [0, 128, 256, 512], resamples=300, seed=0)
    (entry,) = out.cuts
    first, second, third = entry.buckets
    assert abs(first.delta) < 0.005 and abs(second.delta) < 0.005
    assert third.ci[0] < 0.05 < third.ci[1] and third.delta == pytest.approx(0.05, abs=0.005)
    assert entry.all.delta == pytest.approx(float(cut.nll.mean() - whole.nll.mean()))


def test_small_differences_keep_their_digits():
    assert fmt_delta(3.6e-5) == "+3.60e-05" and fmt_delta(-0.0123) == "-0.0123" and fmt_delta(0.0) == "+0.0000"
    assert fmt_delta(-3.95e-12) == "+0.0000" and fmt_delta(2e-9) == "+2.00e-09"




def test_the_headline_compares_the_model_with_itself_cut():
    """The report's headline sets the whole window against the cut (the baseline that needs no
    second model), with the interval's sign deciding the words."""
    from genome_lm.eval.report import headline

    rng = np.random.default_rng(4)
    n, windows = 4000, 8
    context = np.tile(np.arange(1, n // windows + 1), windows)
    window = np.repeat(np.arange(windows), n // windows)
    whole = TokenScores(rng.gamma(2.0, 0.6, n), context, window, rng.random(n) < 0.3)
    worse = TokenScores(whole.nll + np.where(context >= 256, 0.05, 0.0), context, window, whole.softmasked)
    same = TokenScores(whole.nll + rng.normal(0, 0.01, n), context, window, whole.softmasked)
    ablation = summarize(whole, {256: worse, 64: same}, [0, 256, 512], resamples=300, seed=0)
    stat = Stat(tokens=n, nats=float(whole.nll.mean()), nats_ci=(0, 0), bits=1.0, bits_ci=(0, 0))
    report = SimpleNamespace(results={"model": SimpleNamespace(all=stat)}, models={}, comparison=None,
                             ablation=ablation)
    cut64, cut256 = headline(report)
    assert cut256.startswith("model vs the same model with its context cut to 256 bases: loss ")
    assert "lower with the whole window" in cut256 and cut256.endswith("the context beyond it is used")
    delta = float(worse.nll.mean() - whole.nll.mean())
    assert f"({-delta:+.4f} nats/base" in cut256
    assert f"{delta / worse.nll.mean() * 100:.2f}% lower" in cut256
    assert cut64.endswith("no use of the context beyond it shown")


def test_beyond_two_n_pools_the_far_bases_by_subset():
    """``beyond``: the bases with context >= 2N, all / unmasked / soft-masked, each the mean of
    its own bases (checked by hand) with an interval holding the planted shift: the cut costs
    0.08 on far soft-masked bases and nothing on far unmasked ones."""
    from genome_lm.eval.ablation import beyond_line

    rng = np.random.default_rng(4)
    n, windows, N = 6000, 6, 100
    context = np.tile(np.arange(1, n // windows + 1), windows)
    window = np.repeat(np.arange(windows), n // windows)
    soft = rng.random(n) < 0.4
    whole = TokenScores(rng.gamma(2.0, 0.6, n), context, window, soft)
    shift = np.where((context >= 2 * N) & soft, 0.08, 0.0)
    cut = TokenScores(whole.nll + shift + rng.normal(0, 0.005, n), context, window, soft)
    (entry,) = summarize(whole, {N: cut}, [0, 100, 1000, 1001], resamples=400, seed=1).cuts
    far = entry.beyond
    assert far.start == 2 * N
    for key, keep in (("all", context >= 2 * N), ("unmasked", (context >= 2 * N) & ~soft),
                      ("softmasked", (context >= 2 * N) & soft)):
        assert getattr(far, key).tokens == int(keep.sum())
        assert getattr(far, key).delta == pytest.approx(float((cut.nll - whole.nll)[keep].mean()))
        assert getattr(far, key).nats == pytest.approx(float(cut.nll[keep].mean()))
    assert far.softmasked.ci[0] > 0.07 and far.unmasked.ci[0] < 0 < far.unmasked.ci[1]
    line = beyond_line(entry)
    assert "at least 200 bases of context" in line and "soft-masked (repeats) +0.08" in line


def test_baseline_cut_gives_the_gain_over_the_baseline():
    """With the baseline's own whole and cut scores: per bucket, per subset and beyond 2N, the
    model's cut - whole minus the baseline's (checked against a direct mean over tokens), with a
    paired interval that holds the planted difference (the cut costs the model 0.05 beyond N,
    the baseline 0.02: a gain of 0.03 there, none below N); the CSV and the line say so; scores
    on other tokens are refused."""
    from genome_lm.eval.ablation import csv_rows, gain_line

    rng = np.random.default_rng(11)
    n, windows, N = 6000, 8, 100
    context = np.tile(np.arange(1, n // windows + 1), windows)
    window = np.repeat(np.arange(windows), n // windows)
    soft = rng.random(n) < 0.3

    def scores(nll):
        return TokenScores(nll, context, window, soft)

    whole, base = scores(rng.gamma(2.0, 0.6, n)), scores(rng.gamma(2.0, 0.7, n))
    far = context >= N
    cut = scores(whole.nll + 0.05 * far + rng.normal(0, 0.01, n))
    base_cut = scores(base.nll + 0.02 * far + rng.normal(0, 0.01, n))
    edges = [0, 100, 400, 751]
    (entry,) = summarize(whole, {N: cut}, edges, resamples=400, seed=2, baseline=(base, {N: base_cut})).cuts
    gain = (cut.nll - whole.nll) - (base_cut.nll - base.nll)
    for b, (lo, hi) in zip(entry.gain.buckets, zip(edges, edges[1:])):
        keep = (context >= lo) & (context < hi)
        assert b.delta == pytest.approx(float(gain[keep].mean())) and b.tokens == int(keep.sum())
    assert abs(entry.gain.buckets[0].delta) < 0.01
    for b in entry.gain.buckets[1:]:
        assert b.ci[0] < 0.03 < b.ci[1] and b.ci[0] > 0.02
    beyond = context >= 2 * N
    assert entry.gain.beyond.all.delta == pytest.approx(float(gain[beyond].mean()))
    assert entry.gain.softmasked.delta == pytest.approx(float(gain[soft].mean()))
    assert entry.baseline.all.delta == pytest.approx(float((base_cut.nll - base.nll).mean()))
    assert entry.all.delta == pytest.approx(float((cut.nll - whole.nll).mean()))  # the model's own, unchanged
    line = gain_line(entry, "its starting weights")
    assert line.startswith("the context beyond 100 bases is worth +0.03")
    assert "more to the model than to its starting weights" in line
    assert {r["model"] for r in csv_rows(Ablation(model="model", cuts=[entry]))} == {"model", "baseline", "model - "
                                                                                                        "baseline"}
    shifted = TokenScores(base.nll, context, np.roll(window, 1), soft)
    with pytest.raises(ValueError, match="not on the whole-window scores' tokens"):
        summarize(whole, {N: cut}, edges, resamples=10, baseline=(shifted, {N: base_cut}))
