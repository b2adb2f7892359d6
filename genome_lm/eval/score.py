"""Per-token negative log-likelihood on a prepared split, and loss by preceding-context length.

Each evaluation sequence is one window (``seq_len`` = the dataset's window length, so a token's
preceding context is everything before it in its window). The token predicted at input position
i has ``i + 1`` tokens of context. N targets are excluded; soft-masked targets are kept and
flagged so they can be reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TokenScores:
    nll: np.ndarray  # float64 [N] nats
    context: np.ndarray  # int64 [N] preceding tokens in the window
    window: np.ndarray  # int64 [N] window index in the split
    softmasked: np.ndarray  # bool [N]

    @property
    def mean(self) -> float:
        return float(self.nll.mean()) if self.nll.size else float("nan")


@torch.no_grad()
def score_split(model, dataset, split: str, *, seq_len: int, max_windows: int | None = None,
                device: torch.device | str = "cpu") -> TokenScores:
    from genome_lm.data.loader import eval_batches

    model.eval()
    parts = []
    seen = 0
    # weights come back 0 (N target), 0.5 (soft-masked target) or 1: the middle value only flags repeats
    for batch in eval_batches(dataset, split, seq_len=seq_len, batch_size=1, softmask_weight=0.5):
        if max_windows is not None and seen >= max_windows:
            break
        seen += 1
        logits = model(batch.tokens.to(device)).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], batch.labels[0].clamp_min(0).to(device),
                                                reduction="none").cpu().double()
        weight = batch.loss_weight[0]
        keep = weight > 0
        positions = torch.arange(batch.tokens.shape[1]) + batch.offset[0] + 1
        parts.append((nll[keep].numpy(), positions[keep].numpy(), np.full(int(keep.sum()), int(batch.window[0])),
                      (weight[keep] < 1).numpy()))
    model.train()
    if not parts:
        return TokenScores(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
    return TokenScores(*(np.concatenate(x) for x in zip(*parts)))


def power_of_two_buckets(max_context: int) -> list[tuple[int, int]]:
    """[1, 2), [2, 4), ..., up to max_context: the default context-length buckets."""
    edges = [1]
    while edges[-1] < max_context:
        edges.append(edges[-1] * 2)
    return list(zip(edges[:-1], edges[1:]))


def bucket_means(scores: TokenScores, buckets: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for lo, hi in buckets:
        sel = (scores.context >= lo) & (scores.context < hi)
        rows.append({"from": lo, "to": hi, "tokens": int(sel.sum()),
                     "loss": float(scores.nll[sel].mean()) if sel.any() else float("nan")})
    return rows
