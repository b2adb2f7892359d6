"""Context ablation: one model against itself with its context cut (``eval --max-context``).

Every base is scored a second time with at most N preceding tokens (``score.token_nll_cut``:
the window in segments of N inputs, each from scratch), and kept in the bucket of its offset in
the window. Per bucket the report gives loss(cut to N) - loss(whole window) in nats per base,
with a paired bootstrap interval over windows: how much the model's loss there depends on the
context beyond N. Buckets below N are scored on the same context both ways (difference 0 up to
rounding); a model that uses no context beyond a few bases shows 0 everywhere. No second model
is needed, so it applies to any model on any genome.

Report entry (``schema.Ablation``, ``ablation`` in ``eval.json``)::

    {model: "model", cuts: [{max_context: N, all, unmasked, softmasked: Delta, buckets: [Delta + {from, to}],
                            beyond: {from: 2N, all, unmasked, softmasked: Delta}}]}
    Delta = {tokens, nats (cut), delta (cut - whole), ci: [lo, hi]}

With a baseline model (``eval --baseline``) the baseline is cut too: each cut then also has
``baseline`` (the baseline's own Deltas, same layout) and ``gain`` (the model's delta minus the
baseline's on the same tokens, with a paired interval; ``nats`` null): how much more the model's
loss depends on the context beyond N than the baseline's. Unlike the change per bucket, which
compares different bases in each bucket, it compares each base with itself: a positive gain at
long context is fine-tuning that made the far context more useful.

``beyond`` pools the bases with at least 2N bases of context (each then loses at least N bases
of its context to the cut), split into unmasked and soft-masked (repeat) bases: one interval for
"does the model use the far context", and where that use lies.
"""

from __future__ import annotations

import numpy as np

from .buckets import (
    WindowSums,
    bucket_centres,
    difference_interval,
    errorbars,
    finite,
    resample_weights,
    subset_and_bucket_sums,
    subset_sums,
    units_text,
    window_units,
)
from .schema import SUBSETS, Ablation, Beyond, BucketDelta, Cut, Delta, Deltas
from .score import TokenScores


def summarize(full: TokenScores, cuts: dict[int, TokenScores], edges: list[int], *, resamples: int = 1000,
              seed: int = 0, level: float = 0.95, units: tuple[np.ndarray, int] | None = None,
              baseline: tuple[TokenScores, dict[int, TokenScores]] | None = None) -> Ablation:
    """The report entry (module docstring). ``units``: (unit [N], count) of the bootstrap
    (``buckets.bootstrap_units``); default: windows. ``baseline``: the baseline's (whole, {N:
    cut}) scores on the same tokens: each cut then also gives the baseline's own deltas and the
    model's delta minus the baseline's (``gain``)."""
    unit, n_units = units or window_units(full)
    sums = {N: (cut_sums(full, cuts[N], N, edges, unit, n_units),
                None if baseline is None else cut_sums(baseline[0], baseline[1][N], N, edges, unit, n_units, full))
            for N in cuts}
    return summarize_sums(sums, edges, resample_weights(n_units, resamples, seed), level)


def summarize_sums(sums: dict[int, tuple[list, list | None]], edges: list[int], weights: np.ndarray,
                   level: float = 0.95) -> Ablation:
    """``summarize`` from each cut's per-unit sums (``cut_sums`` of the model, and of the
    baseline or None) and the bootstrap's resample weights [R, units]."""
    out = Ablation(model="model", cuts=[])
    for N in sorted(sums):
        model_sums, base_sums = sums[N]
        entry = Cut(max_context=N, **vars(_entry(model_sums, N, edges, weights, level)))
        if base_sums is not None:
            entry.baseline = _entry(base_sums, N, edges, weights, level)
            entry.gain = _entry(model_sums, N, edges, weights, level, than=base_sums)
        out.cuts.append(entry)
    return out


def cut_sums(whole: TokenScores, cut: TokenScores, N: int, edges, unit, n_units,
             tokens_of: TokenScores | None = None) -> list[tuple[WindowSums, WindowSums]]:
    """[(whole, cut) per-unit sums] for the subsets, the buckets and the bases beyond 2N."""
    for scores in (cut, whole) if tokens_of is None else (cut, whole, tokens_of):
        if not whole.same_tokens(scores):
            raise ValueError(f"the context-{N} scores are not on the whole-window scores' tokens")
    parts = list(zip(subset_and_bucket_sums(whole, unit, n_units, edges), subset_and_bucket_sums(cut, unit, n_units,
                                                                                                 edges)))
    far = 2 * N
    parts.append((subset_sums(whole, unit, n_units, whole.context >= far), subset_sums(cut, unit, n_units,
                                                                                       cut.context >= far)))
    return parts


def _entry(sums, N: int, edges, weights, level, than=None) -> Deltas:
    """Subsets, buckets and beyond of loss(cut) - loss(whole); with ``than`` (a baseline's sums on
    the same tokens) that difference minus the baseline's, with a paired interval."""
    stats = [_deltas(b, o, weights, level) if than is None else _gains(b, o, *other, weights, level)
             for (b, o), other in zip(sums, than or sums)]
    return Deltas(**dict(zip(SUBSETS, stats[0])),
                  buckets=[BucketDelta(start=edges[g], end=edges[g + 1], **vars(s)) for g, s in enumerate(stats[1])],
                  beyond=Beyond(start=2 * N, **dict(zip(SUBSETS, stats[2]))))


def _deltas(base: WindowSums, own: WindowSums, weights, level) -> list[Delta]:
    """Per group: tokens, the cut's mean loss, cut - whole and its paired interval."""
    mean = own.means()
    diff, lo, hi = difference_interval(base, own, weights, level)
    return [Delta(tokens=int(own.counts[:, g].sum()), nats=finite(mean[g]), delta=finite(diff[g]),
                  ci=(finite(lo[g]), finite(hi[g]))) for g in range(len(mean))]


def _gains(whole: WindowSums, cut: WindowSums, base_whole: WindowSums, base_cut: WindowSums, weights,
           level) -> list[Delta]:
    """Per group: tokens, the model's cut - whole minus the baseline's, and its paired interval."""
    model = WindowSums(cut.sums - whole.sums, whole.counts)
    base = WindowSums(base_cut.sums - base_whole.sums, whole.counts)
    diff, lo, hi = difference_interval(base, model, weights, level)
    return [Delta(tokens=int(whole.counts[:, g].sum()), nats=None, delta=finite(diff[g]),
                  ci=(finite(lo[g]), finite(hi[g]))) for g in range(len(diff))]


def _measured(stat: Delta) -> bool:
    return bool(stat.tokens) and stat.delta is not None


def beyond_line(cut: Cut) -> str | None:
    """The cut's cost on the bases with at least 2N bases of context, unmasked and soft-masked
    apart, each with its interval (None for a report without it, or no such base)."""
    far = cut.beyond
    if far is None or not _measured(far.all):
        return None
    parts = [f"{name} {fmt_delta_ci(stat)}" for stat, name in ((far.unmasked, "unmasked"),
                                                               (far.softmasked, "soft-masked (repeats)"))
             if _measured(stat)]
    return (f"context cut to {cut.max_context:,}, on the {far.all.tokens:,} bases with at least "
            f"{far.start:,} bases of context: {fmt_delta_ci(far.all)} nats/base"
            + (f" ({'; '.join(parts)})" if parts else "")
            + " [95% CI; above 0: the context beyond the cut lowers the loss]")


def fmt_delta(x: float | None) -> str:
    """A loss difference with enough digits to be read: 3.6e-05 is not "+0.0000"; below 1e-9
    nats/base it is rounding (sums of the same scores in another order), shown as 0."""
    if x is None:
        return "-"
    if abs(x) < 1e-9:
        x = 0.0
    return f"{x:+.2e}" if x != 0 and abs(x) < 1e-3 else f"{x:+.4f}"


def fmt_delta_ci(stat: Delta) -> str:
    lo, hi = stat.ci
    return f"{fmt_delta(stat.delta)} [{fmt_delta(lo)}, {fmt_delta(hi)}]"


def most_hurt(ablation: Ablation) -> list[str]:
    """One line per cut: the context bucket beyond N where cutting the context costs most (the
    overall figure is in the report's headline)."""
    lines = []
    for cut in ablation.cuts:
        N = cut.max_context
        hurt = [b for b in cut.buckets if _measured(b) and b.start >= N]
        if hurt:
            top = max(hurt, key=lambda b: b.delta)
            lines.append(f"context cut to {N:,} costs most at {top.start:,}-{top.end - 1:,} bases of context: "
                         f"{fmt_delta_ci(top)} nats/base")
        if (line := beyond_line(cut)) is not None:
            lines.append(line)
        if (line := gain_line(cut)) is not None:
            lines.append(line)
    return lines


def gain_line(cut: Cut, baseline: str = "the baseline") -> str | None:
    """How much more the model's loss depends on the context beyond the cut than the baseline's,
    on the bases with at least 2N bases of context (None without a baseline or such bases)."""
    gain = cut.gain
    if gain is None or gain.beyond is None or not _measured(gain.beyond.all):
        return None
    g, own, base = gain.beyond.all, cut.beyond.all, cut.baseline.beyond.all
    more = "more" if g.delta >= 0 else "less"
    return (f"the context beyond {cut.max_context:,} bases is worth {fmt_delta_ci(g)} nats/base {more} to the model "
            f"than to {baseline}, on the {g.tokens:,} bases with at least {gain.beyond.start:,} of context "
            f"(cutting it costs the model {fmt_delta(own.delta)}, {baseline} {fmt_delta(base.delta)}; "
            "the same bases both ways)")


def figure(report):
    """loss(cut) - loss(whole window) against the bucket's context, one line per cut
    (``report``: a ``schema.EvalReport`` with an ablation)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, cut in enumerate(report.ablation.cuts):
        stats = [b for b in cut.buckets if b.tokens]
        y, err = errorbars(stats, "delta", "ci")
        ax.errorbar(bucket_centres(stats), y, yerr=err, marker="o", capsize=3, color=f"C{i}",
                    label=f"context cut to {cut.max_context:,}")
        ax.axvline(cut.max_context, color=f"C{i}", lw=0.8, ls="--")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("preceding context in the window (bases)")
    ax.set_ylabel("loss(cut) - loss(whole window), nats/base")
    ax.set_title(f"context ablation (95% CI over {units_text(report)})")
    ax.legend()
    fig.tight_layout()
    return fig


def metrics(ablation: Ablation) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """MLflow: eval/ablation/cut_<N>/delta_<subset>, and per bucket a series by context."""
    flat, series = {}, []
    for cut in ablation.cuts:
        prefix = f"eval/ablation/cut_{cut.max_context}"
        for subset in SUBSETS:
            if getattr(cut, subset).delta is not None:
                flat[f"{prefix}/delta_{subset}"] = getattr(cut, subset).delta
        for b in cut.buckets:
            if _measured(b):
                flat[f"{prefix}/delta_ctx_{b.start}_{b.end}"] = b.delta
                series.append((f"{prefix}/delta_by_context", b.delta, b.start))
        gain = cut.gain
        if gain:
            for subset in SUBSETS:
                for name, stat in ((f"gain_{subset}", getattr(gain, subset)),
                                   (f"gain_beyond_{subset}", getattr(gain.beyond, subset))):
                    if stat.delta is not None:
                        flat[f"{prefix}/{name}"] = stat.delta
            series += [(f"{prefix}/gain_by_context", b.delta, b.start) for b in gain.buckets if _measured(b)]
    return flat, series


def csv_rows(ablation: Ablation) -> list[dict]:
    """Rows of eval.csv: per cut, the model's deltas (and with a baseline, the baseline's and the
    model's minus the baseline's, as models "baseline" and "model - baseline")."""
    rows = []
    for cut in ablation.cuts:
        for model, entry in ((ablation.model, cut), ("baseline", cut.baseline), ("model - baseline", cut.gain)):
            if entry:
                rows += _csv_rows(model, cut.max_context, entry)
    return rows


def _csv_rows(model: str, N: int, cut: Deltas) -> list[dict]:
    parts = [(subset, None, None, getattr(cut, subset)) for subset in SUBSETS]
    parts += [("bucket", b.start, b.end, b) for b in cut.buckets]
    return [{"model": model, "subset": subset, "context_from": lo, "context_to": hi, "tokens": stat.tokens,
             "nats": stat.nats, "max_context": N, "delta_vs_whole_window": stat.delta,
             "delta_ci_low": stat.ci[0], "delta_ci_high": stat.ci[1]} for subset, lo, hi, stat in parts]
