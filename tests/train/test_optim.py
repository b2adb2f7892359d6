import math
from types import SimpleNamespace

import pytest
import torch

from genome_lm.config import TrainConfig
from genome_lm.train.optim import grad_norm, learning_rate


def test_schedule_warmup_then_cosine_to_min():
    t = TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    lrs = [learning_rate(s, t) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone after warm-up
    assert lrs[-1] == pytest.approx(1e-4)
    mid = 10 + (100 - 10 - 1) / 2
    assert learning_rate(int(mid), t) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * int(mid - 10) / 89)))
    const = TrainConfig(steps=5, lr=2e-3, schedule="constant")
    assert {learning_rate(s, const) for s in range(5)} == {2e-3}
    lin = TrainConfig(steps=11, lr=1.0, min_lr=0.0, schedule="linear")
    assert [round(learning_rate(s, lin), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


class _Group:
    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_grad_norm_counts_replicated_params_once_and_shards_on_every_rank():
    sharded = torch.nn.Parameter(torch.zeros(3))
    sharded.tensor_model_parallel = True
    sharded.grad = torch.tensor([3.0, 0.0, 0.0])
    replicated = torch.nn.Parameter(torch.zeros(2))
    replicated.grad = torch.tensor([0.0, 4.0])
    params = [("a.weight", sharded), ("b.weight", replicated)]
    one = SimpleNamespace(tp=_Group(), expt_tp=_Group(), ep=_Group(), pp=_Group())
    assert grad_norm(params, one) == pytest.approx(5.0)
    # on tensor-parallel rank 1 the replicated parameter is not counted again
    second = SimpleNamespace(tp=_Group(rank=1), expt_tp=_Group(), ep=_Group(), pp=_Group())
    assert grad_norm(params, second) == pytest.approx(3.0)
    # main_grad wins over grad when DDP holds the gradient
    replicated.main_grad = torch.tensor([0.0, 0.0])
    assert grad_norm(params, one) == pytest.approx(3.0)
