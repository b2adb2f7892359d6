"""Baselines that need no model, scored on the evaluation's own tokens and bucketed the same way,
so that a report never compares a model only with itself or with random weights:

- ``uniform``: every base 1/4: ln 4 = 1.3863 nats (2 bits) per base.
- ``markov``: an order-k Markov chain over A, C, G, T with add-one smoothing, fitted on the
  dataset's training split; k (0 to ``MAX_ORDER``) is the order with the lowest loss on held-out
  windows of the training split (a tenth of them, evenly spread over it, so that every record of
  the split has its say), then the chain is refitted on all of it. A base
  is predicted from the up to k bases before it in its window that contain no N (fewer at a
  window's start or after an N: the lower order's counts), so every scored base has a score.

Fitting reads at most ``MAX_TRAIN_BASES`` of the training split (windows evenly spread over it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genome_lm.data.tokenizer import A, N

from .schema import ModelInfo
from .score import TokenScores

MAX_ORDER = 8
MAX_TRAIN_BASES = 64_000_000
HELD_OUT = 0.1  # of the training windows (at most 8 Mbp) for choosing the order
LN4 = float(np.log(4.0))


def _codes(tokens: np.ndarray) -> np.ndarray:
    """A, C, G, T -> 0-3; N (and anything else) -> 4."""
    c = tokens.astype(np.int64) - A
    return np.where((c >= 0) & (c < 4), c, 4)


def _contexts(c: np.ndarray, max_order: int):
    """For each order m <= max_order: (context index [L], valid [L]) of the m bases before each
    position (valid: all m are bases and the position itself is a base)."""
    L = c.size
    ctx = np.zeros(L, dtype=np.int64)
    valid = c < 4
    out = [(ctx.copy(), valid.copy())]
    for m in range(1, max_order + 1):
        prev = np.full(L, 4, dtype=np.int64)
        prev[m:] = c[:-m] if m < L else prev[m:]
        ctx = ctx + np.where(prev < 4, prev, 0) * (4 ** (m - 1))
        valid = valid & (prev < 4)
        out.append((ctx.copy(), valid.copy()))
    return out


@dataclass
class MarkovModel:
    order: int
    counts: list[np.ndarray]  # per order m: [4^m, 4] next-base counts
    train_bases: int
    held_out_nats: dict[int, float]  # order -> held-out loss, the choice's evidence

    def nll(self, tokens: np.ndarray) -> np.ndarray:
        """[L - 1] nats of tokens[1:] each given the N-free bases before it in ``tokens`` (up to
        ``order``); NaN where the target is not a base."""
        c = _codes(tokens)
        contexts = _contexts(c, self.order)
        out = np.full(c.size, np.nan)
        done = np.zeros(c.size, dtype=bool)
        for m in range(self.order, -1, -1):  # the longest valid context first
            ctx, valid = contexts[m]
            use = valid & ~done
            if not use.any():
                continue
            table = self.counts[m]
            hits = table[ctx[use], c[use]]
            totals = table.sum(1)[ctx[use]]
            out[use] = -np.log((hits + 1.0) / (totals + 4.0))
            done |= use
        return out[1:]


def _count(windows: list[np.ndarray], max_order: int) -> list[np.ndarray]:
    counts = [np.zeros((4 ** m, 4), dtype=np.int64) for m in range(max_order + 1)]
    for tokens in windows:
        c = _codes(tokens)
        for m, (ctx, valid) in enumerate(_contexts(c, max_order)):
            counts[m] += np.bincount(ctx[valid] * 4 + c[valid], minlength=4 ** (m + 1)).reshape(4 ** m, 4)
    return counts


def _held_out_loss(counts: list[np.ndarray], windows: list[np.ndarray], max_order: int) -> dict[int, float]:
    """Mean nats per base of each order on the positions every order can score (a full context)."""
    sums = np.zeros(max_order + 1)
    n = 0
    for tokens in windows:
        c = _codes(tokens)
        contexts = _contexts(c, max_order)
        scored = contexts[max_order][1]
        n += int(scored.sum())
        for m, (ctx, _) in enumerate(contexts):
            table = counts[m]
            hits = table[ctx[scored], c[scored]]
            sums[m] += float(-np.log((hits + 1.0) / (table.sum(1)[ctx[scored]] + 4.0)).sum())
    return {m: sums[m] / max(n, 1) for m in range(max_order + 1)}


def fit_markov_on(sequences: list[np.ndarray], *, max_order: int = MAX_ORDER) -> MarkovModel:
    """The chain fitted on token arrays (a reference region, not a prepared dataset): the order
    chosen on the last tenth of each sequence with the chain counted on the rest, then refitted
    on all of them."""
    if not sequences or not sum(s.size for s in sequences):
        raise ValueError("no sequence to fit a Markov baseline on")
    cuts = [int(s.size * (1 - HELD_OUT)) for s in sequences]
    held_loss = _held_out_loss(_count([s[:c] for s, c in zip(sequences, cuts)], max_order),
                               [s[c:] for s, c in zip(sequences, cuts)], max_order)
    best = min(held_loss, key=lambda m: (held_loss[m], m))
    return MarkovModel(best, _count(sequences, best), int(sum(s.size for s in sequences)), held_loss)


def fit_markov(dataset, split: str = "train", *, max_order: int = MAX_ORDER,
               max_bases: int = MAX_TRAIN_BASES) -> MarkovModel:
    """Choose the order on held-out training windows, then fit on the training split."""
    from genome_lm.data.loader import SplitReader

    reader = SplitReader(dataset, split)
    lengths = reader.lengths
    if lengths.size == 0:
        raise ValueError(f"{dataset}: split {split!r} has no windows to fit a Markov baseline on")
    order = np.arange(lengths.size)
    if lengths.sum() > max_bases:  # windows evenly spread over the split
        take = max(1, int(lengths.size * max_bases / lengths.sum()))
        order = np.unique(np.linspace(0, lengths.size - 1, take).round().astype(int))
    chosen = [int(i) for i in order]
    n_held = max(1, int(round(len(chosen) * HELD_OUT))) if len(chosen) > 1 else 0
    # evenly spread, not the split's end: a split of chr1, chr2 and a copy drill would otherwise
    # choose the order on the drill alone (random bases: order 0)
    at = set(np.linspace(0, len(chosen) - 1, n_held + 2)[1:-1].round().astype(int).tolist()) if n_held else set()
    fit_part = [w for i, w in enumerate(chosen) if i not in at]
    held_part = [w for i, w in enumerate(chosen) if i in at]
    held = [reader.tokens(i)[:8_000_000] for i in held_part]
    if not fit_part:  # one window: hold out its last tenth
        tokens = reader.tokens(chosen[0])
        cut = int(tokens.size * (1 - HELD_OUT))
        fit_windows, held = [tokens[:cut]], [tokens[cut:]]
    else:
        fit_windows = [reader.tokens(i) for i in fit_part]
    held_loss = _held_out_loss(_count(fit_windows, max_order), held, max_order)
    best = min(held_loss, key=lambda m: (held_loss[m], m))
    everything = fit_windows + held
    return MarkovModel(best, _count(everything, best), int(sum(t.size for t in everything)), held_loss)


def baseline_scores(scores: TokenScores, dataset, split: str, markov: MarkovModel | None) -> dict[str, TokenScores]:
    """The uniform and (when fitted) Markov baselines on exactly the tokens of ``scores`` (a model's
    scores of ``split``): same windows, positions, masks."""
    from genome_lm.data.loader import SplitReader

    same = dict(context=scores.context, window=scores.window, softmasked=scores.softmasked)
    out = {"uniform": TokenScores(np.full(scores.nll.size, LN4), **same)}
    if markov is None:
        return out
    reader = SplitReader(dataset, split)
    nll = []
    for w in np.unique(scores.window):  # score_split's order: windows ascending as given, N targets dropped
        tokens = reader.tokens(int(w))
        keep = tokens[1:] != N
        nll.append(markov.nll(tokens)[keep])
    markov_nll = np.concatenate(nll) if nll else np.zeros(0)
    if markov_nll.size != scores.nll.size:
        raise ValueError("the Markov baseline's tokens differ from the model's")
    out["markov"] = TokenScores(markov_nll, **same)
    return out


def describe(markov: MarkovModel | None) -> dict[str, ModelInfo]:
    """The report's ``models`` entries of the baselines."""
    uniform = {"uniform": ModelInfo(kind="baseline", description="uniform over A, C, G, T (2 bits per base)")}
    if markov is None:
        return uniform
    return {**uniform,
            "markov": ModelInfo(kind="baseline", order=markov.order,
                                description=f"order-{markov.order} Markov chain, add-one smoothing, fitted on "
                                            f"{markov.train_bases:,} training bases; order chosen on held-out "
                                            "training windows",
                                held_out_nats_by_order={str(k): v for k, v in markov.held_out_nats.items()})}
