"""mHC's Sinkhorn normalisation with its recomputing backward against autograd through the plain
loop (written out here as transformers' glm5_next writes it), in float64 and float32."""

import pytest
import torch

from genome_lm.model import common
from genome_lm.model.common import sinkhorn


def _loop(z, iters, eps):
    comb = torch.softmax(z, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("n", [2, 4])
def test_matches_autograd_through_the_loop(monkeypatch, dtype, tol, iters, n):
    monkeypatch.setattr(common._Sinkhorn, "BLOCK", 7)  # several uneven backward blocks
    g = torch.Generator().manual_seed(iters * 10 + n)
    z = (3 * torch.randn(5, 13, n, n, generator=g, dtype=dtype)).requires_grad_()
    upstream = torch.randn(5, 13, n, n, generator=g, dtype=dtype)
    got = sinkhorn(z, iters, 1e-6)
    (dz_got,) = torch.autograd.grad(got, z, upstream)
    want = _loop(z, iters, 1e-6)
    (dz_want,) = torch.autograd.grad(want, z, upstream)
    assert (got - want).abs().max() <= tol
    assert (dz_got - dz_want).abs().max() <= tol * dz_want.abs().max()


def test_gradcheck():
    z = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, 4, 1e-6), (z,))
