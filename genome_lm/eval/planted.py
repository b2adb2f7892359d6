"""The demo genome's planted copies: does the model use a first copy it can see?

The demo genome (``genome_lm.data.demo_genome``) plants later copies (duplications and
inverted copies) of earlier segments and lists them in ``<genome>.planted.json``. For each
scored base inside a later copy, its *source base* is the base it was copied from (for an
inversion, the mirrored one). The copy base is

- *in context* when its source base lies inside the same window (before it, so the model saw
  it), and
- *out of context* when the source lies before the window start.

Both groups are bases of planted copies with the same composition; only whether the first copy
is visible differs. A model that uses long context has lower loss in context: the *copy
advantage* is loss(out of context) - loss(in context) in nats, with a 95% bootstrap interval
over copies (each group's copies resampled with replacement, seeded). Losses are also binned by
the distance from source base to copy base, with the copy advantage and its interval per bin.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from genome_lm.errors import GenomeLMError

from .schema import Advantage, CopyGroup, DistanceRow, Planted, PlantedModel
from .score import TokenScores

LEVEL = 0.95
MIN_COPIES_FOR_CI = 3  # per group and distance bin: resampling one or two copies gives no interval worth the name


def load_planted(path: Path) -> list[dict]:

    try:
        data = json.loads(Path(path).read_text())
        return list(data["planted"])
    except (OSError, ValueError, KeyError) as exc:
        raise GenomeLMError(f"{path}: not a planted-copies file ({exc})") from None


def copy_positions(scores: TokenScores, windows, planted: list[dict]):
    """For each scored token: (copy index or -1, source-base distance, in-context flag).
    ``windows``: the split's manifest windows (chrom, start)."""
    start = np.array([windows[w].start for w in scores.window.tolist()], dtype=np.int64) if scores.window.size \
        else np.zeros(0, np.int64)
    chrom = np.array([windows[w].chrom for w in scores.window.tolist()], dtype=object)
    pos = start + scores.context
    copy = np.full(pos.size, -1, dtype=np.int64)
    src = np.zeros(pos.size, dtype=np.int64)
    for name in set(chrom.tolist()):
        on = np.flatnonzero(chrom == name)
        events = [(i, c) for i, c in enumerate(planted) if c["chrom"] == name]
        if not events:
            continue
        events.sort(key=lambda e: e[1]["dst_start"])
        starts = np.array([c["dst_start"] for _, c in events])
        ends = np.array([c["dst_end"] for _, c in events])
        j = np.searchsorted(starts, pos[on], side="right") - 1
        inside = (j >= 0) & (pos[on] < ends[np.maximum(j, 0)])
        for k in np.flatnonzero(inside):
            i, c = events[j[k]]
            t = on[k]
            offset = pos[t] - c["dst_start"]
            copy[t] = i
            src[t] = c["src_start"] + offset if c["kind"] == "duplication" else c["src_end"] - 1 - offset
    in_context = (copy >= 0) & (src >= start)
    return copy, pos - src, in_context


def _group_mean(nll, copy_ids, rng, resamples):
    """Token-weighted mean over copies and its bootstrap interval over copies."""
    if nll.size == 0:
        return None, (None, None), 0
    ids, inv = np.unique(copy_ids, return_inverse=True)
    sums = np.bincount(inv, weights=nll)
    counts = np.bincount(inv).astype(np.float64)
    draws = rng.multinomial(ids.size, np.full(ids.size, 1 / ids.size), size=resamples).astype(np.float64)
    means = (draws @ sums) / np.maximum(draws @ counts, 1e-300)
    return float(sums.sum() / counts.sum()), means, int(ids.size)


def analyse(scores: dict[str, TokenScores], windows, planted: list[dict], *, resamples: int = 1000,
            seed: int = 0) -> Planted:
    """The planted-copies section of the report (``schema.Planted``), per model."""
    first = next(iter(scores.values()))
    copy, distance, in_context = copy_positions(first, windows, planted)
    on_copy = copy >= 0
    lo_q, hi_q = (1 - LEVEL) / 2 * 100, (1 + LEVEL) / 2 * 100
    edges = [0] + [1 << k for k in range(10, 21)]
    out = Planted(copies_total=len(planted), tokens_on_copies=int(on_copy.sum()),
                  tokens_in_context=int(in_context.sum()), tokens_out_of_context=int((on_copy & ~in_context).sum()),
                  distance_edges=edges, models={})
    advantages = {}  # name -> the advantage's bootstrap samples (the same resampled copies for every model)
    for name, s in scores.items():
        rng = np.random.default_rng(seed)  # reset per model: each model's draws are the same, so paired
        groups = {}
        samples = {}
        for group, sel in (("in_context", in_context), ("out_of_context", on_copy & ~in_context)):
            mean, means, n_copies = _group_mean(s.nll[sel], copy[sel], rng, resamples)
            samples[group] = means
            ci = (None, None) if mean is None else tuple(float(x) for x in np.percentile(means, [lo_q, hi_q]))
            groups[group] = CopyGroup(tokens=int(sel.sum()), copies=n_copies, nats=mean, nats_ci=ci)
        advantage = None
        if groups["in_context"].nats is not None and groups["out_of_context"].nats is not None:
            diff = samples["out_of_context"] - samples["in_context"]
            ci = np.percentile(diff, [lo_q, hi_q])
            advantage = Advantage(nats=groups["out_of_context"].nats - groups["in_context"].nats,
                                  ci=(float(ci[0]), float(ci[1])), excludes_zero=bool(ci[0] > 0 or ci[1] < 0))
            advantages[name] = diff
        background = s.nll[~on_copy]
        by_distance = []
        for a, b in zip(edges[:-1], edges[1:]):
            row, drawn = {"start": a, "end": b}, {}
            for group, sel in (("in_context", in_context), ("out_of_context", on_copy & ~in_context)):
                pick = sel & (distance >= a) & (distance < b)
                row[f"{group}_tokens"] = int(pick.sum())
                row[f"{group}_nats"], drawn[group], row[f"{group}_copies"] = _group_mean(s.nll[pick], copy[pick],
                                                                                        rng, resamples)
            row = DistanceRow(**row, advantage=None, advantage_ci=(None, None))
            if row.in_context_nats is not None and row.out_of_context_nats is not None:
                row.advantage = row.out_of_context_nats - row.in_context_nats
                if min(row.in_context_copies, row.out_of_context_copies) >= MIN_COPIES_FOR_CI:
                    ci = np.percentile(drawn["out_of_context"] - drawn["in_context"], [lo_q, hi_q])
                    row.advantage_ci = (float(ci[0]), float(ci[1]))
            if row.in_context_tokens or row.out_of_context_tokens:
                by_distance.append(row)
        out.models[name] = PlantedModel(**groups, background_nats=float(background.mean()) if background.size else None,
                                        advantage=advantage, by_distance=by_distance)
    if "model" in advantages and "baseline" in advantages:
        out.models["model"].change_vs_baseline = _change(out.models["model"].advantage,
                                                         out.models["baseline"].advantage,
                                                         advantages["model"] - advantages["baseline"])
    return out


def _change(model: Advantage, baseline: Advantage, paired: np.ndarray) -> Advantage:
    """The model's copy advantage minus the baseline's, with a paired interval: both models'
    bootstrap samples drew the same copies, so their difference per draw is the difference's."""
    lo, hi = np.percentile(paired, [(1 - LEVEL) / 2 * 100, (1 + LEVEL) / 2 * 100])
    return Advantage(nats=model.nats - baseline.nats, ci=(float(lo), float(hi)), excludes_zero=bool(lo > 0 or hi < 0))


def verdict(section: Planted, name: str = "model") -> str:
    """One sentence on whether ``name`` uses the first copy it can see."""
    entry = section.models.get(name)
    if entry is None or entry.advantage is None:
        return ("planted copies: not enough scored copy bases in and out of context to compare "
                f"({section.tokens_in_context:,} in, {section.tokens_out_of_context:,} out)")
    adv = entry.advantage
    lo, hi = adv.ci
    text = (f"planted copies ({name}): loss out of context {entry.out_of_context.nats:.4f} vs in context "
            f"{entry.in_context.nats:.4f} nats/base, copy advantage {adv.nats:+.4f} (95% CI {lo:+.4f} to "
            f"{hi:+.4f})")
    if lo > 0:
        return text + ": it uses the first copy when it lies in the window"
    return text + ": the interval does not exclude zero, no measurable use of the first copy"


def by_distance_line(section: Planted, name: str = "model") -> str | None:
    """The copy advantage per distance bin with its interval, in one line (None: no bin has
    copies both in and out of context)."""
    entry = section.models.get(name)
    rows = [r for r in entry.by_distance if r.advantage is not None] if entry else []
    if not rows:
        return None

    def size(x: int) -> str:
        return f"{x >> 10}k" if x >= 1024 and x % 1024 == 0 else str(x)

    def interval(r: DistanceRow) -> str:
        lo, hi = r.advantage_ci
        if lo is None:
            return f"[no interval: {r.in_context_copies} copies in, {r.out_of_context_copies} out]"
        return f"[{lo:+.3f}, {hi:+.3f}]"

    parts = [f"{size(r.start)}-{size(r.end)} {r.advantage:+.3f} {interval(r)}" for r in rows]
    return f"copy advantage by distance from the first copy ({name}), nats/base [95% CI]: " + ", ".join(parts)


def distance_figure(section: Planted, ax=None):
    """Loss on planted copy bases against their distance to the source base, per model; filled
    markers: source inside the window, open: outside; dotted: the model's loss off copies.
    ``ax``: draw into it instead of a new figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    fig = ax.figure
    plotted = False
    for k, (name, entry) in enumerate(section.models.items()):
        color = f"C{k}"
        for group, fill in (("in_context", color), ("out_of_context", "none")):
            rows = [(r.start, r.end, getattr(r, f"{group}_nats")) for r in entry.by_distance]
            rows = [(a, b, nats) for a, b, nats in rows if nats is not None]
            x = [math.sqrt(max(a, 1) * b) for a, b, _ in rows]
            plotted = plotted or bool(rows)
            ax.plot(x, [nats for _, _, nats in rows], "o-" if fill != "none" else "o--",
                    color=color, markerfacecolor=fill, label=f"{name}, first copy {group.replace('_', ' ')}")
        if entry.background_nats is not None:
            ax.axhline(entry.background_nats, color=color, ls=":", lw=1)
    if plotted:
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no scored base lies in a planted copy", ha="center", transform=ax.transAxes)
    ax.set_xlabel("distance from the first copy (bases)")
    ax.set_ylabel("loss on the later copy (nats per base)")
    ax.set_title("planted copies: dotted = loss off copies")
    fig.tight_layout()
    return fig
