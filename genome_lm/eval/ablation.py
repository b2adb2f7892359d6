"""Context ablation: one model against itself with its context cut (``eval --max-context``).

Every base is scored a second time with at most N preceding tokens (``score.token_nll_cut``:
the window in segments of N inputs, each from scratch), and kept in the bucket of its offset in
the window. Per bucket the report gives loss(cut to N) - loss(whole window) in nats per base,
with a paired bootstrap interval over windows: how much the model's loss there depends on the
context beyond N. Buckets below N are scored on the same context both ways (difference 0 up to
rounding); a model that uses no context beyond a few bases shows 0 everywhere. No second model
is needed, so it applies to any model on any genome.

Report entry (``ablation`` in ``eval.json``)::

    {model: "model", cuts: [{max_context: N, all, unmasked, softmasked: Delta, buckets: [Delta + {from, to}],
                            beyond: {from: 2N, all, unmasked, softmasked: Delta}}]}
    Delta = {tokens, nats (cut), delta (cut - whole), ci: [lo, hi]}

``beyond`` pools the bases with at least 2N bases of context (each then loses at least N bases
of its context to the cut), split into unmasked and soft-masked (repeat) bases: one interval for
"does the model use the far context", and where that use lies.
"""

from __future__ import annotations

import numpy as np

from .buckets import (SUBSETS, WindowSums, bucket_centres, difference_interval, errorbars, finite,
                      resample_weights, subset_and_bucket_sums, subset_sums)
from .score import TokenScores


def summarize(full: TokenScores, cuts: dict[int, TokenScores], edges: list[int], *, resamples: int = 1000,
              seed: int = 0, level: float = 0.95) -> dict:
    windows, window_pos = np.unique(full.window, return_inverse=True)
    weights = resample_weights(len(windows), resamples, seed)
    base = subset_and_bucket_sums(full, window_pos, len(windows), edges)
    out = {"model": "model", "cuts": []}
    for N in sorted(cuts):
        scores = cuts[N]
        if not (np.array_equal(scores.context, full.context) and np.array_equal(scores.window, full.window)):
            raise ValueError(f"the context-{N} scores are not on the whole-window scores' tokens")
        own = subset_and_bucket_sums(scores, window_pos, len(windows), edges)
        entry: dict = {"max_context": N}
        for part, (b, o) in enumerate(zip(base, own)):
            stats = _deltas(b, o, weights, level)
            if part == 0:
                entry.update(zip(SUBSETS, stats))
            else:
                entry["buckets"] = [{"from": edges[g], "to": edges[g + 1], **s} for g, s in enumerate(stats)]
        far = 2 * N
        stats = _deltas(subset_sums(full, window_pos, len(windows), full.context >= far),
                        subset_sums(scores, window_pos, len(windows), scores.context >= far), weights, level)
        entry["beyond"] = {"from": far, **dict(zip(SUBSETS, stats))}
        out["cuts"].append(entry)
    return out


def _deltas(base: WindowSums, own: WindowSums, weights, level) -> list[dict]:
    """Per group: tokens, the cut's mean loss, cut - whole and its paired interval."""
    mean = own.means()
    diff, lo, hi = difference_interval(base, own, weights, level)
    return [{"tokens": int(own.counts[:, g].sum()), "nats": finite(mean[g]), "delta": finite(diff[g]),
             "ci": [finite(lo[g]), finite(hi[g])]} for g in range(len(mean))]


def beyond_line(cut: dict) -> str | None:
    """The cut's cost on the bases with at least 2N bases of context, unmasked and soft-masked
    apart, each with its interval (None for a report without it, or no such base)."""
    far = cut.get("beyond")
    if not far or not far["all"]["tokens"] or far["all"]["delta"] is None:
        return None
    parts = [f"{name} {fmt_delta_ci(far[key])}" for key, name in (("unmasked", "unmasked"),
                                                                  ("softmasked", "soft-masked (repeats)"))
             if far[key]["tokens"] and far[key]["delta"] is not None]
    return (f"context cut to {cut['max_context']:,}, on the {far['all']['tokens']:,} bases with at least "
            f"{far['from']:,} bases of context: {fmt_delta_ci(far['all'])} nats/base" + (f" ({'; '.join(parts)})" if parts else "")
            + " [95% CI; above 0: the context beyond the cut lowers the loss]")


def fmt_delta(x: float | None) -> str:
    """A loss difference with enough digits to be read: 3.6e-05 is not "+0.0000"."""
    if x is None:
        return "-"
    return f"{x:+.2e}" if x != 0 and abs(x) < 1e-3 else f"{x:+.4f}"


def fmt_delta_ci(stat: dict) -> str:
    lo, hi = stat["ci"]
    return f"{fmt_delta(stat['delta'])} [{fmt_delta(lo)}, {fmt_delta(hi)}]"


def most_hurt(ablation: dict) -> list[str]:
    """One line per cut: the context bucket beyond N where cutting the context costs most (the
    overall figure is in the report's headline)."""
    lines = []
    for cut in ablation["cuts"]:
        N = cut["max_context"]
        hurt = [b for b in cut["buckets"] if b["tokens"] and b["delta"] is not None and b["from"] >= N]
        if hurt:
            top = max(hurt, key=lambda b: b["delta"])
            lines.append(f"context cut to {N:,} costs most at {top['from']:,}-{top['to'] - 1:,} bases of context: "
                         f"{fmt_delta_ci(top)} nats/base")
        if (line := beyond_line(cut)) is not None:
            lines.append(line)
    return lines


def figure(report: dict):
    """loss(cut) - loss(whole window) against the bucket's context, one line per cut."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, cut in enumerate(report["ablation"]["cuts"]):
        stats = [b for b in cut["buckets"] if b["tokens"]]
        y, err = errorbars(stats, "delta", "ci")
        ax.errorbar(bucket_centres(stats), y, yerr=err, marker="o", capsize=3, color=f"C{i}",
                    label=f"context cut to {cut['max_context']:,}")
        ax.axvline(cut["max_context"], color=f"C{i}", lw=0.8, ls="--")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("preceding context in the window (bases)")
    ax.set_ylabel("loss(cut) - loss(whole window), nats/base")
    ax.set_title("context ablation (95% CI over windows)")
    ax.legend()
    fig.tight_layout()
    return fig


def metrics(ablation: dict) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """MLflow: eval/ablation/cut_<N>/delta_<subset>, and per bucket a series by context."""
    flat, series = {}, []
    for cut in ablation["cuts"]:
        prefix = f"eval/ablation/cut_{cut['max_context']}"
        for subset in ("all", "unmasked", "softmasked"):
            if cut[subset]["delta"] is not None:
                flat[f"{prefix}/delta_{subset}"] = cut[subset]["delta"]
        for b in cut["buckets"]:
            if b["tokens"] and b["delta"] is not None:
                flat[f"{prefix}/delta_ctx_{b['from']}_{b['to']}"] = b["delta"]
                series.append((f"{prefix}/delta_by_context", b["delta"], b["from"]))
    return flat, series


def csv_rows(ablation: dict) -> list[dict]:
    rows = []
    for cut in ablation["cuts"]:
        parts = [(subset, None, None, cut[subset]) for subset in ("all", "unmasked", "softmasked")]
        parts += [("bucket", b["from"], b["to"], b) for b in cut["buckets"]]
        for subset, lo, hi, stat in parts:
            rows.append({"model": ablation["model"], "subset": subset, "context_from": lo, "context_to": hi,
                         "tokens": stat["tokens"], "nats": stat["nats"], "max_context": cut["max_context"],
                         "delta_vs_whole_window": stat["delta"], "delta_ci_low": stat["ci"][0],
                         "delta_ci_high": stat["ci"][1]})
    return rows
