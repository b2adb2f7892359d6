"""Context parallel (CP) plumbing: the zigzag split of a sequence and the head-wise all-to-all.

Split (megatron-core's convention): a sequence of length T is cut into 2*cp equal chunks and
CP rank r holds chunks r and 2*cp-1-r, in that order. Causal work grows along the sequence, so
pairing an early chunk with a late one gives every rank the same amount of it.

Everything per token (embedding, mHC, norms, projections, MLP/MoE, the loss) runs on a rank's
local tokens unchanged. Only the sequence mixers need other ranks' tokens, and they use the
"Ulysses" head-wise all-to-all (as megatron-core's gated delta net and SkyRL do): before the
mixer, [local tokens, all heads] becomes [all T tokens in natural order, heads / cp]; the mixer
(KDA recurrence, sparse attention) runs on whole sequences of a head group with the unchanged
single-process kernels; a second all-to-all turns the output back. Exact by construction:
each head's computation is the single-process one. A parameter a rank uses for only its head
group (e.g. a slice of the KDA conv weight) gets a gradient on that slice only; summing over
the CP group, which megatron-core's DDP does over the data+context parallel group, completes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else group.size()


def heads_per_rank(n_heads: int, tp: int, cp: int, what: str) -> int:
    """Heads one rank computes: tensor parallel splits the heads, and the CP all-to-all splits
    each tensor-parallel rank's heads again, so ``n_heads`` must be divisible by tp*cp."""
    if n_heads % (tp * cp):
        raise ValueError(f"{what} ({n_heads}) is not divisible by tensor parallel x context parallel "
                         f"({tp} x {cp} = {tp * cp})")
    return n_heads // (tp * cp)


def zigzag_split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The part of a full sequence that CP rank ``rank`` holds: chunks rank and 2*cp-1-rank of
    ``dim`` (tokens [B, T] -> [B, T / cp] with the default dim). Without CP, x itself."""
    if not 0 <= rank < cp:
        raise ValueError(f"context parallel rank {rank} outside 0..{cp - 1}")
    if cp == 1:
        return x
    T = x.shape[dim]
    if T % (2 * cp):
        raise ValueError(f"sequence length {T} is not divisible by 2 * context parallel = {2 * cp} "
                         "(each rank holds two zigzag chunks); pad the sequence")
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def pad_for_cp(x: torch.Tensor, cp: int, value, dim: int = 1) -> torch.Tensor:
    """``x`` padded with ``value`` at the end of ``dim`` to the next multiple of 2 * cp, so that
    ``zigzag_split`` can cut it. The model is causal, so trailing padding changes nothing before
    it; the caller gives padded positions no label and no loss weight."""
    extra = -x.shape[dim] % (2 * cp)
    if cp == 1 or extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim)


def zigzag_merge(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int = 1) -> torch.Tensor:
    """Inverse of ``zigzag_split``: the parts of CP ranks 0..cp-1 -> the sequence in natural order."""
    cp = len(parts)
    lengths = {part.shape[dim] for part in parts}
    if cp == 0 or len(lengths) != 1 or min(lengths) % 2:
        raise ValueError(f"zigzag parts must be one per rank, of one even length; got lengths "
                         f"{[part.shape[dim] for part in parts]}")
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim)
    return torch.cat(chunks, dim)  # type: ignore[arg-type]


def _seq_to_heads(x: torch.Tensor, seq_dim: int, head_dim: int, group) -> torch.Tensor:
    send = torch.stack(x.chunk(group.size(), head_dim)).contiguous()  # [cp, ..local tokens.., heads/cp]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens of my head group
    return zigzag_merge(recv.unbind(0), seq_dim)


def _heads_to_seq(y: torch.Tensor, seq_dim: int, head_dim: int, group) -> torch.Tensor:
    cp = group.size()
    send = torch.stack([zigzag_split(y, cp, j, seq_dim) for j in range(cp)]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: my tokens of head group j
    return torch.cat(recv.unbind(0), head_dim)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_dim, head_dim, group):
        ctx.dims, ctx.group = (seq_dim, head_dim), group
        return _seq_to_heads(x, seq_dim, head_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, *ctx.dims, ctx.group), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, seq_dim, head_dim, group):
        ctx.dims, ctx.group = (seq_dim, head_dim), group
        return _heads_to_seq(y, seq_dim, head_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, *ctx.dims, ctx.group), None, None, None


def seq_to_heads(x: torch.Tensor, group, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """[.., T/cp local tokens (zigzag), .., H, ..] -> [.., T tokens (natural order), .., H/cp, ..]:
    this rank's head group (heads rank*H/cp onwards) for the whole sequence. Differentiable."""
    if group_size(group) == 1:
        return x
    return _SeqToHeads.apply(x, seq_dim, head_dim, group)


def heads_to_seq(y: torch.Tensor, group, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: [.., T, .., H/cp, ..] -> [.., T/cp local tokens, .., H, ..]."""
    if group_size(group) == 1:
        return y
    return _HeadsToSeq.apply(y, seq_dim, head_dim, group)


def head_slice(n: int, group) -> slice:
    """The rows of a per-head tensor of size ``n`` (all of this tensor-parallel rank's heads)
    that belong to this CP rank's head group after ``seq_to_heads``."""
    cp = group_size(group)
    if cp == 1:
        return slice(0, n)
    width = n // cp
    return slice(group.rank() * width, (group.rank() + 1) * width)


class _GatherSequence(torch.autograd.Function):
    """All-gather forward; backward: the summed gradient of every rank, this rank's zigzag part."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return gather_sequence(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return zigzag_split(grad, ctx.group.size(), ctx.group.rank(), ctx.dim), None, None


def gather_sequence_with_grad(x: torch.Tensor, group, *, dim: int) -> torch.Tensor:
    """``gather_sequence`` for an input that needs its gradient (the DSA layer's shared MLA latent,
    which every CP rank attends over in full): each rank gets back the sum of all ranks'
    gradients at its own positions."""
    if group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim)


@torch.no_grad()
def gather_sequence(x: torch.Tensor, group, *, dim: int) -> torch.Tensor:
    """The whole sequence in natural order from every CP rank's local part, without gradient
    (for inputs that are detached anyway: the DSA indexer's and its loss's)."""
    if group_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return zigzag_merge(parts, dim)
