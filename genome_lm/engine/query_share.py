"""Per-query work shared out over the ranks of a tensor x context parallel group.

The DSA indexer's selection and its loss are per query: a query's pools and its KL term depend
on the (replicated, gathered) indexer keys and on that query alone. Without sharing, every rank
of a TP x CP group selects for the whole sequence: the same O(T^2 / kpool) work done tp x cp
times (a third of the published 1M step). ``QueryShare`` cuts the queries into the kernels'
blocks of ``chunk`` queries and gives each rank some of them; the group then all-gathers the
results (``gather``), so every rank ends with the whole sequence's selection, bit for bit the
one-process one (each block is the block a whole-sequence call computes).

Causal work grows along the sequence, so blocks are dealt as context parallel deals tokens:
the blocks are cut into 2n runs and rank r takes runs r and 2n-1-r (an early run with a late
one). Run j starts at block j * blocks // 2n, so any block count works (a rank may get a block
fewer than another, or none when there are fewer blocks than ranks).

A loss computed per block this way is a share on each rank; ``summed_over`` gives every rank
the group's total as the value while the gradient stays the rank's own share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .context_parallel import group_size


class QueryShare:
    """Which rank of ``group`` takes each block of ``chunk`` queries of a ``T``-query sequence."""

    def __init__(self, T: int, chunk: int, group):
        self.T, self.chunk, self.group = T, chunk, group
        self.size = group_size(group)
        self.rank = group.rank() if self.size > 1 else 0
        blocks = -(-T // chunk)
        runs = 2 * self.size
        self.owners = [0] * blocks
        for run in range(runs):
            owner = run if run < self.size else runs - 1 - run
            for block in range(run * blocks // runs, (run + 1) * blocks // runs):
                self.owners[block] = owner

    def owns(self, block: int) -> bool:
        return self.owners[block] == self.rank

    def ranges(self, rank: int | None = None) -> list[tuple[int, int]]:
        """The query ranges [first, end) of ``rank``'s blocks (this rank's by default), runs of
        consecutive blocks merged, in order."""
        rank = self.rank if rank is None else rank
        out: list[tuple[int, int]] = []
        for block, owner in enumerate(self.owners):
            if owner != rank:
                continue
            t0, t1 = block * self.chunk, min((block + 1) * self.chunk, self.T)
            if out and out[-1][1] == t0:
                out[-1] = (out[-1][0], t1)
            else:
                out.append((t0, t1))
        return out

    def count(self, rank: int) -> int:
        return sum(t1 - t0 for t0, t1 in self.ranges(rank))

    def gather(self, part: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows (its ranges' queries along ``dim``, concatenated in order) -> the
        whole sequence's, from every rank of the group (one all-gather, padded to the largest
        share)."""
        if self.size == 1:
            return part
        counts = [self.count(r) for r in range(self.size)]
        if part.shape[dim] != counts[self.rank]:
            raise ValueError(f"QueryShare.gather: rank {self.rank} holds {part.shape[dim]} queries, its share is "
                             f"{counts[self.rank]}")
        width = max(counts)
        padded = torch.nn.functional.pad(part.movedim(dim, -1), (0, width - counts[self.rank])).movedim(-1, dim)
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        shape = list(part.shape)
        shape[dim] = self.T
        whole = part.new_empty(shape)
        for rank, got in enumerate(parts):
            offset = 0
            for t0, t1 in self.ranges(rank):
                whole.narrow(dim, t0, t1 - t0).copy_(got.narrow(dim, offset, t1 - t0))
                offset += t1 - t0
        return whole

    def reduce_to_owner(self, block_sum: torch.Tensor, block: int) -> torch.Tensor | None:
        """Sum a per-rank tensor of query block ``block`` over the group onto the block's owner:
        the sum there, None on the other ranks."""
        if self.size == 1:
            return block_sum
        dist.reduce(block_sum, dst=dist.get_global_rank(self.group, self.owners[block]), group=self.group)
        return block_sum if self.owns(block) else None


class _SummedOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scale):
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return total * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def summed_over(share: torch.Tensor, group, scale: float = 1.0) -> torch.Tensor:
    """``scale`` x the sum of ``share`` over ``group`` as the value, with the gradient of
    ``share`` alone (unscaled): each rank's backward stays its own share's (the gradients are
    summed afterwards, as parameter gradients), while every rank reports the loss."""
    if group_size(group) == 1:
        return share * scale
    return _SummedOver.apply(share, group, scale)
