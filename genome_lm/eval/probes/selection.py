"""Does the DSA indexer pick the source of a copy?

A model copies a base of a later copy by attending, from the position before it, to its source
base (the key whose preceding bases match and whose value is the base to predict). A DSA layer
attends only to the tokens its indexer selects, so copying at a distance needs the indexer to
select the source. For each scored copy base j (a forward duplication whose source base s lies
in the window), this counts how often the selection of the query at j - 1 contains s, per DSA
layer with its own indexer, against chance: the share of the visible tokens it selects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..score import model_device

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model


@dataclass
class SelectionCounts:
    layer: int  # the model's layer number
    copies: int  # copy bases counted
    hits: int  # of them, those whose source token was selected
    chance: float  # mean over the counted queries of selected / visible tokens

    @property
    def rate(self) -> float:
        return self.hits / self.copies if self.copies else float("nan")

    def add(self, other: "SelectionCounts") -> "SelectionCounts":
        n = self.copies + other.copies
        chance = (self.chance * self.copies + other.chance * other.copies) / n if n else 0.0
        return SelectionCounts(self.layer, n, self.hits + other.hits, chance)


def window_sources(start: int, length: int, planted: list[dict], chrom: str) -> np.ndarray:
    """[length] int64: for each base of the window ``[start, start + length)`` of ``chrom``, the
    window position of its source base when it is a forward duplication's copy whose source lies
    before it in the window, else -1."""
    source = np.full(length, -1, dtype=np.int64)
    for c in planted:
        if c["chrom"] != chrom or c["kind"] != "duplication":
            continue
        lo, hi = max(c["dst_start"], start), min(c["dst_end"], start + length)
        if lo >= hi:
            continue
        src = np.arange(lo, hi) - c["dst_start"] + c["src_start"] - start
        source[lo - start:hi - start] = np.where(src >= 0, src, -1)
    return source


@torch.no_grad()
def source_selection(model: GLM5Model, tokens: np.ndarray, source: np.ndarray,
                     token_map: torch.Tensor | None = None) -> list[SelectionCounts]:
    """Counts for one window: ``tokens`` [L] genome-lm ids, ``source`` [L] (``window_sources``).
    One forward over the window (its DSA selections captured by hooks); one entry per DSA layer
    that runs its own indexer."""
    layers = [(i, layer.self_attention) for i, layer in enumerate(model.layers)
              if getattr(layer.self_attention, "indexer", None) is not None]
    captured: dict[int, torch.Tensor] = {}
    hooks = [attn.register_forward_hook(lambda _m, _in, out, i=i: captured.__setitem__(i, out.idx))
             for i, attn in layers]
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    if token_map is not None:
        ids = token_map[ids]
    try:
        model(ids.to(model_device(model))[None, :-1])
    finally:
        for hook in hooks:
            hook.remove()
    j = np.flatnonzero(source[1:] >= 0) + 1  # targets with a visible source (never position 0)
    queries = torch.from_numpy(j - 1)
    wanted = torch.from_numpy(source[j])[:, None]
    counts = []
    for i, _ in layers:
        idx = captured[i][0].cpu()[queries]  # [n, slots], -1 = empty
        hits = int((idx == wanted).any(dim=1).sum())
        chance = float(((idx >= 0).sum(dim=1).double() / (queries + 1).double()).mean()) if len(j) else 0.0
        layer = int(model.global_name(f"layers.{i}.w").split(".")[1])  # numbered as in the whole model
        counts.append(SelectionCounts(layer, len(j), hits, chance))
    return counts


def split_selection(model: GLM5Model, dataset, planted: list[dict], *, chrom: str | None = None,
                    split: str = "eval", max_windows: int = 2, length: int | None = None,
                    token_map: torch.Tensor | None = None) -> list[SelectionCounts]:
    """``source_selection`` summed over up to ``max_windows`` windows of a prepared dataset's
    ``split`` (of ``chrom`` when given; evenly spaced), each cut to its first ``length`` bases."""
    from genome_lm.data.loader import SplitReader

    reader = SplitReader(dataset, split)
    candidates = [i for i, w in enumerate(reader.windows) if chrom is None or w.chrom == chrom]
    chosen = [candidates[i] for i in np.linspace(0, len(candidates) - 1, min(max_windows, len(candidates))).astype(int)]
    total: list[SelectionCounts] | None = None
    for w in chosen:
        window = reader.windows[w]
        tokens = reader.tokens(w, 0, length)
        counts = source_selection(model, tokens, window_sources(window.start, len(tokens), planted, window.chrom),
                                  token_map)
        total = counts if total is None else [a.add(b) for a, b in zip(total, counts)]
    return total or []


def describe(counts: list[SelectionCounts]) -> list[str]:
    """One line per DSA layer: ``layer 3 selected the source of 61.2% of 5,120 copy bases (chance 9.8%)``."""
    return [f"DSA layer {c.layer}: its indexer selected the source of {c.rate:.1%} of {c.copies:,} copied bases "
            f"(chance {c.chance:.1%})" for c in counts if c.copies]
