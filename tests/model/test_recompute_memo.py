"""recompute_memo: a checkpointed call's recompute gets back, in order, what its forward recorded."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from genome_lm.model import recompute_memo
from genome_lm.model.recompute_memo import Memo, reuse


class Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return torch.tensor(float(self.calls))


def test_outside_a_checkpoint_it_computes():
    count = Counter()
    assert [reuse(count).item() for _ in range(3)] == [1.0, 2.0, 3.0]


def test_replay_hands_back_the_recorded_values_in_order_through_pack_and_unpack():
    count, memo = Counter(), Memo()
    with memo.recording():
        first = [reuse(count, pack=lambda v: v.to(torch.int32), unpack=lambda v: v.double()) for _ in range(2)]
    for _ in range(2):  # a second backward (retain_graph) replays from the start
        with memo.replaying():
            again = [reuse(count, pack=lambda v: v.to(torch.int32), unpack=lambda v: v.double()) for _ in range(2)]
        assert [v.item() for v in again] == [v.item() for v in first] and again[0].dtype == torch.float64
    assert count.calls == 2
    with memo.replaying(), pytest.raises(RuntimeError, match="more values than its forward recorded"):
        for _ in range(3):
            reuse(count)


def test_nested_checkpoints_compute_once():
    """A checkpoint inside a checkpoint (recompute_nested): the outer recompute replays to the
    inner forward, which records it for the inner recompute; one computation in all."""
    count = Counter()
    x = torch.randn(5, requires_grad=True)

    def checkpointed(fn, *args):
        memo = Memo()
        return checkpoint(fn, *args, use_reentrant=False, context_fn=memo.contexts)

    def inner(t):
        return t.sin() * reuse(count)

    def outer(t):
        return checkpointed(inner, t.cos()).exp()

    y = checkpointed(outer, x).sum()
    y.backward()
    assert count.calls == 1
    ref = x.detach().clone().requires_grad_()
    (ref.cos().sin() * 1.0).exp().sum().backward()
    assert torch.allclose(x.grad, ref.grad)
    assert recompute_memo._stack() == []
