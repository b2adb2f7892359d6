"""Planted-copies analysis: source bases, in/out-of-context split and the copy advantage."""

import numpy as np
import pytest

from genome_lm.data.manifest import Window
from genome_lm.eval.planted import analyse, by_distance_line, copy_positions, verdict
from genome_lm.eval.schema import Advantage, CopyGroup, Planted, PlantedModel
from genome_lm.eval.score import TokenScores


def _window(chrom, start, length):
    return Window(chrom, start, start + length, 0.0, 0.0, 0.0)


def _scores(windows, nll=None):
    ctx = [np.arange(1, w.length) for w in windows]
    win = [np.full(w.length - 1, i) for i, w in enumerate(windows)]
    context, window = np.concatenate(ctx), np.concatenate(win)
    nll = np.zeros(context.size) if nll is None else nll
    return TokenScores(nll, context, window, np.zeros(context.size, bool))


def _copy(kind, src, dst, length, chrom="chr22"):
    return {"chrom": chrom, "kind": kind, "src_start": src, "src_end": src + length, "dst_start": dst,
            "dst_end": dst + length, "distance": dst - src, "divergence": 0.0}


def test_copy_positions_hand_computed():
    windows = [_window("chr22", 1000, 1000), _window("chr22", 2000, 1000), _window("chr1", 1000, 1000)]
    planted = [_copy("duplication", 1100, 1500, 100),  # source inside window 0
               _copy("inversion", 500, 1700, 50),  # source before window 0
               _copy("duplication", 950, 1300, 100),  # source straddles window 0's start
               _copy("duplication", 1100, 1500, 100, chrom="chr2")]  # another chromosome: never matched
    s = _scores(windows)
    copy, distance, in_context = copy_positions(s, windows, planted)
    pos = np.array([windows[w].start for w in s.window]) + s.context
    on0 = s.window == 0

    a = on0 & (pos >= 1500) & (pos < 1600)
    assert (copy[a] == 0).all() and in_context[a].all() and (distance[a] == 400).all()
    b = on0 & (pos >= 1700) & (pos < 1750)
    o = pos[b] - 1700
    assert (copy[b] == 1).all() and not in_context[b].any()
    np.testing.assert_array_equal(distance[b], pos[b] - (549 - o))  # mirrored source base
    c = on0 & (pos >= 1300) & (pos < 1400)
    np.testing.assert_array_equal(in_context[c], pos[c] - 1300 >= 50)  # source base 950 + o >= 1000
    assert (copy[~(a | b | c)] == -1).all()
    assert int(a.sum() + b.sum() + c.sum()) == 250


def _many_copies(rng, n=40):
    """n copies in one 200 kbp window: half with the source inside, half before it."""
    windows = [_window("chr22", 100_000, 200_000)]
    planted = []
    for i in range(n):
        dst = 110_000 + i * 4000
        src = dst - 2000 if i % 2 == 0 else 50_000 + i * 1000  # even: inside the window; odd: before it
        planted.append(_copy("duplication" if i % 4 < 2 else "inversion", src, dst, 300))
    return windows, planted


def test_copy_advantage_and_its_interval():
    rng = np.random.default_rng(0)
    windows, planted = _many_copies(rng)
    s = _scores(windows)
    _, _, in_context = copy_positions(s, windows, planted)
    copy_ids, _, _ = copy_positions(s, windows, planted)
    # a model that uses the visible first copy: 0.3 nats lower there (copy-level noise)
    per_copy = rng.normal(0, 0.05, len(planted))
    nll = 1.2 + rng.normal(0, 0.2, s.nll.size) + np.where(copy_ids >= 0, per_copy[copy_ids], 0)
    used = nll - 0.3 * in_context
    section = analyse({"model": TokenScores(used, s.context, s.window, s.softmasked),
                       "baseline": TokenScores(nll, s.context, s.window, s.softmasked)}, windows, planted,
                      resamples=300, seed=0)
    assert section.tokens_in_context == 20 * 300 and section.tokens_out_of_context == 20 * 300
    adv = section.models["model"].advantage
    assert abs(adv.nats - 0.3) < 0.06 and adv.excludes_zero and adv.ci[0] > 0.15
    base = section.models["baseline"].advantage
    assert base.ci[0] < 0 < base.ci[1] and not base.excludes_zero
    assert "uses the first copy" in verdict(section, "model")
    assert "does not exclude zero" in verdict(section, "baseline")
    rows = section.models["model"].by_distance
    assert sum(r.in_context_tokens for r in rows) == 20 * 300
    assert all(r.advantage is None for r in rows)  # in context at 2 kbp, out at 60-100 kbp: no bin has both
    assert by_distance_line(section, "model") is None
    again = analyse({"model": TokenScores(used, s.context, s.window, s.softmasked)}, windows, planted,
                    resamples=300, seed=0)
    assert again.models["model"].advantage == adv  # seeded
    assert again.models["model"].change_vs_baseline is None  # no baseline to set it against


def test_the_change_in_copy_advantage_is_paired_over_copies():
    """The model's copy advantage minus its baseline's, with an interval from the same resampled
    copies: a model 0.3 nats better on in-context copies and otherwise its baseline has a change of
    exactly 0.3 in every draw, while each model's own interval is as wide as the copies' noise."""
    rng = np.random.default_rng(3)
    windows, planted = _many_copies(rng)
    s = _scores(windows)
    copy_ids, _, in_context = copy_positions(s, windows, planted)
    per_copy = rng.normal(0, 0.3, len(planted))  # copy-level noise: wide unpaired intervals
    nll = 1.2 + rng.normal(0, 0.05, s.nll.size) + np.where(copy_ids >= 0, per_copy[copy_ids], 0)
    section = analyse({"model": TokenScores(nll - 0.3 * in_context, s.context, s.window, s.softmasked),
                       "baseline": TokenScores(nll, s.context, s.window, s.softmasked)}, windows, planted,
                      resamples=400, seed=0)
    model, base = section.models["model"], section.models["baseline"]
    change = model.change_vs_baseline
    assert change.nats == pytest.approx(model.advantage.nats - base.advantage.nats)
    assert change.nats == pytest.approx(0.3, abs=1e-9)
    assert change.ci[0] == pytest.approx(0.3, abs=1e-9) and change.ci[1] == pytest.approx(0.3, abs=1e-9)
    assert change.excludes_zero
    assert base.advantage.ci[1] - base.advantage.ci[0] > 0.1  # unpaired, the copies' noise shows
    assert base.change_vs_baseline is None
    # the baseline 0.1 nats worse on half the copies out of context: a change with a real interval
    worse = nll + 0.1 * ((copy_ids % 4 == 1) & ~in_context)  # 10 of the 20 copies out of context
    mixed = analyse({"model": TokenScores(nll, s.context, s.window, s.softmasked),
                     "baseline": TokenScores(worse, s.context, s.window, s.softmasked)}, windows, planted,
                    resamples=400, seed=0)
    lo, hi = mixed.models["model"].change_vs_baseline.ci
    assert lo < mixed.models["model"].change_vs_baseline.nats < hi and hi < 0


@pytest.mark.parametrize("gain", [0.3, 0.0])
def test_copy_advantage_per_distance_bin(gain):
    """Copies at the same distances (1.5-3.5 kbp) with the source inside or just before the window:
    each distance bin's advantage is its two groups' difference, with an interval that holds it."""
    rng = np.random.default_rng(1)
    windows, planted = [], []
    for w in range(30):
        start = 100_000 + w * 50_000
        windows.append(_window("chr22", start, 20_000))
        for dst, d in ((start + 200, 1500 + 60 * w), (start + 10_000, 1500 + 60 * w)):  # source before / inside
            planted.append(_copy("duplication", dst - d, dst, 300))
    s = _scores(windows)
    copy_ids, distance, in_context = copy_positions(s, windows, planted)
    assert in_context.sum() == (copy_ids >= 0).sum() // 2
    per_copy = rng.normal(0, 0.05, len(planted))
    nll = 1.2 + rng.normal(0, 0.2, s.nll.size) + np.where(copy_ids >= 0, per_copy[copy_ids], 0) - gain * in_context
    section = analyse({"model": TokenScores(nll, s.context, s.window, s.softmasked)}, windows, planted,
                      resamples=300, seed=0)
    rows = [r for r in section.models["model"].by_distance if r.advantage is not None]
    assert [(r.start, r.end) for r in rows] == [(1024, 2048), (2048, 4096)]
    for r in rows:
        pick = (distance >= r.start) & (distance < r.end) & (copy_ids >= 0)
        want = nll[pick & ~in_context].mean() - nll[pick & in_context].mean()
        assert r.advantage == pytest.approx(want)
        assert r.advantage_ci[0] < gain < r.advantage_ci[1]
    line = by_distance_line(section, "model")
    assert line.startswith("copy advantage by distance from the first copy (model), nats/base [95% CI]: 1k-2k ")
    assert f"2k-4k {rows[1].advantage:+.3f} [{rows[1].advantage_ci[0]:+.3f}, " in line
    # two copies in a bin: its difference, but no interval
    few = analyse({"model": TokenScores(nll, s.context, s.window, s.softmasked)}, windows, planted[:2],
                  resamples=300, seed=0)
    (row,) = few.models["model"].by_distance
    assert row.advantage is not None and row.advantage_ci == (None, None)
    assert row.in_context_copies == row.out_of_context_copies == 1
    assert "1k-2k" in by_distance_line(few) and "[no interval: 1 copies in, 1 out]" in by_distance_line(few)
    assert by_distance_line(_section(None)) is None


def _section(advantage, tokens_in=6000, tokens_out=5000):
    """A hand-built planted-copies section (the shape ``analyse`` returns) with one model;
    ``advantage``: {nats, ci, excludes_zero} or None."""
    entry = PlantedModel(in_context=CopyGroup(tokens=tokens_in, copies=20, nats=1.1, nats_ci=(1.0, 1.2)),
                         out_of_context=CopyGroup(tokens=tokens_out, copies=20, nats=1.3, nats_ci=(1.2, 1.4)),
                         background_nats=1.35, by_distance=[],
                         advantage=None if advantage is None else Advantage(**{**advantage,
                                                                               "ci": tuple(advantage["ci"])}))
    return Planted(copies_total=40, tokens_on_copies=tokens_in + tokens_out, tokens_in_context=tokens_in,
                   tokens_out_of_context=tokens_out, distance_edges=[0, 1024], models={"model": entry})
