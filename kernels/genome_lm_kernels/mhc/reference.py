"""mHC's three operations written out plainly (transformers' glm5_next's order of operations),
autograd through every step: the precision reference the torch and C paths are tested against.

    sinkhorn(z [.., N, N]) = the Sinkhorn normalisation of softmax(z over columns) + eps:
        rows of the columns' sums first, then (rows, columns) x (iters - 1), each x / (sum + eps)
    collapse(pre [.., N], streams [.., N, D]) = sum_n pre[n] streams[n]           (the block's input)
    merge(post, comb, y, streams) = post[j] y + sum_i comb[i, j] streams[i]      (the new streams)
"""

from __future__ import annotations

import torch


def sinkhorn(z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = torch.softmax(z, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams
