"""The weighted LM loss against an independent sum(w * ce) / sum(w), written here with log_softmax:
uneven lengths, weight 0 (N targets, ignored labels), soft-mask weights and 1; the gradient at a
position is w / sum(w) times (softmax - one-hot), so exactly zero where w = 0; chunked equals
unchunked, for chunks that do not divide the length."""

import pytest
import torch

from genome_lm.data.loader import IGNORE
from genome_lm.train.loss import chunked_lm_loss, lm_loss

V = 11
SOFT = 0.1


def _reference(logits_BTV, labels_BT, weights_BT):
    """sum(w * ce) / sum(w), cross-entropy from log_softmax; labels without a target count as class 0
    (their weight is 0, so any class gives the same sum)."""
    logp = torch.log_softmax(logits_BTV.double(), dim=-1)
    target = torch.where(labels_BT < 0, torch.zeros_like(labels_BT), labels_BT)
    ce = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    w = weights_BT.double()
    return (w * ce).sum() / w.sum(), ce


def _batch(B, T, seed, lengths):
    """Random logits, labels and weights for sequences of uneven length (``lengths``): past a
    sequence's end the label is IGNORE (-100) and the weight 0; inside, some targets are N (weight
    0, label -1 here as another kind of ignored label, or a real class), some soft-masked (0.1)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    weights = torch.ones(B, T)
    kind = torch.randint(0, 4, (B, T), generator=g)
    weights[kind == 1] = SOFT  # soft-masked
    weights[kind == 2] = 0.0  # N target: weight 0, label kept
    labels[kind == 3] = -1  # a label with no target
    weights[kind == 3] = 0.0
    for b, n in enumerate(lengths):
        labels[b, n:] = IGNORE
        weights[b, n:] = 0.0
    return logits, labels, weights


@pytest.mark.parametrize("B,T,lengths,seed", [(3, 37, (37, 20, 5), 0), (2, 64, (64, 1), 1), (1, 13, (13,), 2)])
def test_lm_loss_is_the_weighted_mean_and_its_gradient(B, T, lengths, seed):
    logits, labels, weights = _batch(B, T, seed, lengths)
    assert (weights == SOFT).any() and (weights == 0).any() and (weights == 1).any()
    expected, _ = _reference(logits, labels, weights)
    x = logits.clone().requires_grad_(True)
    parts = lm_loss(x, labels, weights, global_weight=weights.sum())
    assert parts.lm.item() == pytest.approx(expected.item(), rel=1e-5)
    assert parts.total.item() == pytest.approx(expected.item(), rel=1e-5)  # no indexer loss
    assert parts.weight_sum.item() == pytest.approx(weights.sum().item())
    assert parts.lm_sum.item() == pytest.approx((expected * weights.double().sum()).item(), rel=1e-5)
    parts.total.backward()
    grad = x.grad
    # exactly zero where the weight is 0 (N targets, -1 and IGNORE labels, past the end)
    zero = weights == 0
    assert torch.equal(grad[zero], torch.zeros_like(grad[zero]))
    # elsewhere w / sum(w) * (softmax - one-hot): scales with the weight (0.1 at soft-masked bases)
    onehot = torch.nn.functional.one_hot(labels.clamp_min(0), V).double()
    analytic = (weights.double() / weights.double().sum())[..., None] * (torch.softmax(x.detach(), -1) - onehot)
    torch.testing.assert_close(grad, analytic, rtol=1e-5, atol=1e-7)
    soft, full = weights == SOFT, weights == 1
    unit = grad / (weights.double() / weights.double().sum())[..., None].clamp_min(1e-30)
    torch.testing.assert_close(unit[soft], (torch.softmax(x.detach(), -1) - onehot)[soft], rtol=1e-5, atol=1e-7)
    assert grad[soft].abs().max() < grad[full].abs().max()


def test_global_weight_divides_and_indexer_loss_adds():
    """A rank's share: divided by the global batch's weight, not its own; the indexer loss adds with its factor."""
    logits, labels, weights = _batch(2, 9, 3, (9, 4))
    expected, _ = _reference(logits, labels, weights)
    parts = lm_loss(logits, labels, weights, global_weight=weights.sum() * 4, indexer_losses=[torch.tensor(0.5),
                                                                                                 torch.tensor(0.25)],
                    indexer_coeff=2.0)
    assert parts.lm.item() == pytest.approx(expected.item() / 4, rel=1e-5)
    assert parts.indexer.item() == pytest.approx(0.75)
    assert parts.total.item() == pytest.approx(expected.item() / 4 + 1.5, rel=1e-5)


class _Head(torch.nn.Module):
    """An output layer like megatron-core's: [S, B, D] -> ([S, B, V], bias)."""

    def __init__(self, D, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(V, D, generator=g, dtype=torch.float64))
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return h @ self.weight.t(), None


@pytest.mark.parametrize("chunk", [1, 5, 7, 16, 37, 64])
def test_chunked_equals_unchunked_and_the_reference(chunk):
    B, T, D = 3, 37, 6
    _, labels, weights = _batch(B, T, 4, (37, 23, 2))
    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(T, B, D, generator=g, dtype=torch.float64)

    head_a = _Head(D, 6)
    h_a = h0.clone().requires_grad_(True)
    logits = head_a(h_a)[0].transpose(0, 1)
    plain = lm_loss(logits, labels, weights, global_weight=weights.sum())
    plain.total.backward()

    head_b = _Head(D, 6)
    h_b = h0.clone().requires_grad_(True)
    chunked = chunked_lm_loss(head_b, h_b, labels, weights, global_weight=weights.sum(), chunk=chunk)
    forward_calls = head_b.calls
    chunked.total.backward()

    expected, _ = _reference((h0 @ head_a.weight.detach().t()).transpose(0, 1), labels, weights)
    assert chunked.lm.item() == pytest.approx(expected.item(), rel=1e-5)
    assert chunked.lm.item() == pytest.approx(plain.lm.item(), rel=1e-5)
    assert chunked.weight_sum.item() == pytest.approx(plain.weight_sum.item())
    assert forward_calls == -(-T // chunk)  # one output-layer call per block, the last one short
    torch.testing.assert_close(h_b.grad, h_a.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(head_b.weight.grad, head_a.weight.grad, rtol=1e-5, atol=1e-8)
    # positions whose weight is 0 pass no gradient back to the hidden states
    zero = (weights == 0).transpose(0, 1)  # [T, B]
    assert torch.equal(h_b.grad[zero], torch.zeros_like(h_b.grad[zero]))
