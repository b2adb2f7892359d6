"""Scoring over many ranks: the windows of an evaluation split among groups of ranks, each group
running the model split by tensor, context and expert parallelism.

- A **window group** is the set of ranks that score one window together, in lockstep. Without
  expert parallelism it is one data-parallel replica (its tensor- and context-parallel ranks),
  and the replicas share out the windows. An expert-parallel group spans data-parallel ranks,
  whose MoE dispatch must run the same forwards, so under expert parallelism every rank scores
  every window together.
- Inside a group, a window runs whole (``WholeForward``): tensor parallel gathers the logits
  over the vocabulary; context parallel gives each rank its zigzag part of the window (padded at
  the end to a multiple of 2 x cp, which no earlier position sees) and all-gathers the logits.
  A group of one rank runs the chunked prefill as a single process does (``--chunk``); a split
  model scores a window in one forward, its memory bounded by the split instead.
- **Rank 0 keeps the scores.** It says which windows still need scoring (those not in its
  per-window cache), the groups score them in rounds of one window per group, and after each
  round rank 0 gathers the groups' scores and writes them to the cache at once: a killed run
  re-run with the same arguments scores only what is missing. Rank 0 then reads every window
  from the cache and writes the report exactly as a one-process evaluation does.

Pipeline parallelism is not used for scoring (``check_sizes``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.engine.parallel import ParallelSizes


def check_sizes(sizes: ParallelSizes) -> None:
    if sizes.pp > 1:
        raise GenomeLMError(f"eval under pipeline parallel (pp={sizes.pp}) is not built yet: score with tensor, "
                            "context, expert and data parallel (--set parallel.pp=1)")


def window_groups(pg, sizes: ParallelSizes) -> tuple[int, int, bool]:
    """(this rank's group, number of groups, whether this rank reports its group's scores)."""
    inner_lead = pg.tp.rank() == 0 and pg.cp.rank() == 0
    if sizes.ep > 1:
        return 0, 1, dist.get_rank() == 0
    return pg.dp.rank(), pg.dp.size(), inner_lead


class WholeForward:
    """``forward(ids [B, T]) -> .logits [B, T, V]``, whole on every rank of a window group, for a
    model split by tensor, context and expert parallelism (see the module docstring)."""

    def __init__(self, model, pg, pad_id: int = 0):
        self.model, self.pg, self.pad_id = model, pg, pad_id
        self.training = False

    def parameters(self):
        return self.model.parameters()

    def eval(self):
        self.model.eval()
        return self

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor):
        cp = self.pg.cp.size()
        if cp == 1:
            return SimpleNamespace(logits=self.model(ids).logits)
        from genome_lm.engine.context_parallel import zigzag_merge, zigzag_split

        T = ids.shape[1]
        padded = torch.nn.functional.pad(ids, (0, (-T) % (2 * cp)), value=self.pad_id)
        logits = self.model(zigzag_split(padded, cp, self.pg.cp.rank())).logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(cp)]
        dist.all_gather(parts, logits, group=self.pg.cp)
        return SimpleNamespace(logits=zigzag_merge(parts, dim=1)[:, :T])


def split_model(sizes: ParallelSizes) -> bool:
    """Whether a window group holds more than one rank (the model split inside it)."""
    return sizes.tp * sizes.cp > 1 or sizes.ep > 1


def score_into_cache(model, dataset, split: str, windows: list[int], *, cache, pg, sizes: ParallelSizes,
                     chunk: int | None, token_map, max_context: int | None, on_done=None) -> None:
    """Collective over every rank: score each of ``windows`` missing from rank 0's ``cache`` and
    store it there (rank 0 writes). ``on_done(n)`` (rank 0): n more predicted tokens are in the
    cache, windows found there already included."""
    from genome_lm.data.loader import SplitReader

    from .score import token_nll, token_nll_cut

    rank = dist.get_rank()
    reader = SplitReader(dataset, split)
    missing = [None]
    if rank == 0:
        missing[0] = [w for w in windows if not cache.has(w)]
        if on_done is not None:
            on_done(sum(reader.windows[w].length - 1 for w in windows if w not in set(missing[0])))
    dist.broadcast_object_list(missing, src=0)
    missing = missing[0]
    group, groups, lead = window_groups(pg, sizes)
    split = split_model(sizes)
    forward = WholeForward(model, pg, pad_id=model.cfg.pad_token_id or 0) if split else model
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(missing), groups):
            mine = missing[first + group] if first + group < len(missing) else None
            result = None
            if mine is not None:
                tokens = reader.tokens(mine)
                kwargs = dict(chunk=None if split else chunk, token_map=token_map)
                nll = (token_nll(forward, tokens, **kwargs) if max_context is None
                       else token_nll_cut(forward, tokens, max_context, **kwargs))
                result = (mine, nll) if lead else None
            gathered = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
            if rank == 0:
                for item in gathered:
                    if item is not None:
                        w, nll = item
                        cache.store(w, np.asarray(nll, dtype=np.float64))
                        if on_done is not None:
                            on_done(len(nll))
    finally:
        model.train(was_training)
