"""What a demo's report measured, in words, each figure with the sign it has (``genome-lm demo``).

The demo's closing lines must never read better than its own numbers. They set the tuned model
against the seed's finding (the loss falls with fine-tuning, most on the bases with the longest
preceding context), against its starting weights, the Markov chain and its own context cut, and
on the demo genome's planted copies; each line says which way the figure points and whether its
95% interval excludes no change.
"""

from __future__ import annotations

from .ablation import fmt_delta, fmt_delta_ci
from .schema import Advantage, BucketChange, EvalReport, Stat, interval_side


def _pct(change) -> str:
    lo, hi = change.ci
    return f"{change.change * 100:+.2f}% [{lo * 100:+.2f}%, {hi * 100:+.2f}%]"


def _span(b) -> str:
    return f"{b.start:,}-{b.end - 1:,}"


def seed_finding(report: EvalReport) -> str | None:
    """Whether the report shows the seed's finding: the tuned model's loss below its starting
    weights' (interval below zero), and the fall largest in the longest context bucket measured.
    None without a comparison against the starting weights."""
    comparison = report.comparison
    if comparison is None or not comparison.all.measured:
        return None
    buckets: list[BucketChange] = [b for b, r in zip(comparison.buckets, report.results["model"].buckets)
                                   if r.tokens and b.measured]
    overall = f"{_pct(comparison.all)} against its starting weights"
    side = interval_side(comparison.all.ci)
    if side != -1:
        fell = "rose" if side == 1 else "did not measurably change"
        return f"The seed's finding is not reproduced here: fine-tuning's loss {fell} ({overall})."
    if not buckets:
        return f"Fine-tuning lowered the loss ({overall}); no context bucket was measured apart."
    most, longest = min(buckets, key=lambda b: b.change), buckets[-1]
    if most is longest:
        return (f"The seed's finding holds here: fine-tuning lowered the loss ({overall}), most at the longest "
                f"context measured ({_span(longest)} bases: {_pct(longest)}).")
    return (f"The seed's finding is not reproduced here: fine-tuning lowered the loss ({overall}), but most at "
            f"{_span(most)} bases of context ({_pct(most)}), not at the longest ({_span(longest)}: "
            f"{_pct(longest)}).")


def markov_line(report: EvalReport) -> str | None:
    """The tuned model against the order-k Markov chain, the sign in words."""
    if "markov" not in report.results:
        return None
    model, markov = report.results["model"].all, report.results["markov"].all
    if model.bits is None or markov.bits is None:
        return None
    lo, hi = model.bits_ci
    change = (model.bits - markov.bits) / markov.bits * 100
    order = report.models["markov"].order
    figures = f"{model.bits:.4f} [{lo:.4f}, {hi:.4f}] vs {markov.bits:.4f} bits/base"
    side = interval_side(model.bits_ci, at=markov.bits)
    if side == -1:
        words = f"the tuned model beats it, {-change:.2f}% lower"
    elif side == 1:
        words = f"the chain is {change:.2f}% better: the tuned model does not beat it"
    else:
        words = "level with it (the chain lies within the model's interval)"
    return f"Against an order-{order} Markov chain fitted on the training split ({figures}): {words}."


def _cost(stat: Stat | None, who: str) -> str:
    return f"cutting it costs {who} {fmt_delta_ci(stat)} nats/base"


def far_context_lines(report: EvalReport) -> list[str]:
    """Per context cut: whether the tuned model uses the context beyond it, and whether that
    context is worth more to it than to its start."""
    lines = []
    for cut in report.ablation.cuts if report.ablation else []:
        own = cut.all
        if own.delta is None or interval_side(own.ci) is None:
            continue
        uses = {1: "used", -1: "hurts", 0: "not measurably used"}[interval_side(own.ci)]
        line = f"The context beyond {cut.max_context:,} bases: {uses} ({_cost(own, 'the tuned model')}"
        gain = cut.gain.all if cut.gain else None
        if gain is not None and gain.delta is not None and interval_side(gain.ci) is not None:
            more = {1: "more to it than to its start", -1: "less to it than to its start",
                    0: "to it as much as to its start (no measurable difference)"}[interval_side(gain.ci)]
            line += (f"; its start {fmt_delta(cut.baseline.all.delta)}); it is worth {more}: "
                     f"{fmt_delta_ci(gain)} nats/base.")
        else:
            line += ")."
        lines.append(line)
    return lines


def _advantage(adv: Advantage) -> str:
    return f"{adv.nats:+.4f} [{adv.ci[0]:+.4f}, {adv.ci[1]:+.4f}]"


def planted_line(report: EvalReport) -> str | None:
    """The copy advantage (loss on planted copies whose first copy lies outside the window minus
    inside it) of the tuned model, of its start, and the paired change fine-tuning made."""
    planted = report.planted
    entry = planted.models.get("model") if planted else None
    if entry is None or entry.advantage is None:
        return None
    adv = entry.advantage
    seen = {1: "it uses a first copy in the window", 0: "no measurable use of a first copy in the window",
            -1: "it does worse where the first copy is in the window"}[interval_side(adv.ci)]
    line = (f"Planted copies: the tuned model's loss is {_advantage(adv)} nats/base lower where the first copy "
            f"lies in the window ({seen})")
    start = planted.models.get("baseline")
    change = entry.change_vs_baseline
    if start is None or start.advantage is None or change is None:
        return line + "."
    lo, hi = change.ci
    moved = {1: "fine-tuning raised it", -1: "fine-tuning lowered it",
             0: "fine-tuning changed it by no measurable amount"}[interval_side(change.ci)]
    return line + (f"; its start's was {_advantage(start.advantage)}: {moved}, {change.nats:+.4f} "
                   f"[{lo:+.4f}, {hi:+.4f}] (paired over the same copies).")


def demo_verdict(report: EvalReport) -> list[str]:
    """The demo's closing lines (95% intervals in brackets): the seed's finding held or not,
    then the tuned model against the Markov chain, its own context cut, and the planted copies."""
    lines = [seed_finding(report), markov_line(report), *far_context_lines(report), planted_line(report)]
    return [line for line in lines if line is not None]
