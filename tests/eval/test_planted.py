"""Planted-copies analysis: source bases, in/out-of-context split and the copy advantage."""

import numpy as np

from genome_lm.data.manifest import Window
from genome_lm.eval.planted import analyse, copy_positions, verdict
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
    assert section["tokens_in_context"] == 20 * 300 and section["tokens_out_of_context"] == 20 * 300
    adv = section["models"]["model"]["advantage"]
    assert abs(adv["nats"] - 0.3) < 0.06 and adv["excludes_zero"] and adv["ci"][0] > 0.15
    base = section["models"]["baseline"]["advantage"]
    assert base["ci"][0] < 0 < base["ci"][1] and not base["excludes_zero"]
    assert "uses the first copy" in verdict(section, "model")
    assert "does not exclude zero" in verdict(section, "baseline")
    rows = section["models"]["model"]["by_distance"]
    assert sum(r["in_context_tokens"] for r in rows) == 20 * 300
    again = analyse({"model": TokenScores(used, s.context, s.window, s.softmasked)}, windows, planted,
                    resamples=300, seed=0)
    assert again["models"]["model"]["advantage"] == adv  # seeded
