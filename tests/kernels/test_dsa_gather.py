"""The torch sparse attention's two chunk strategies (key union, per-query gather) each match the
dense reference, forward and every gradient, including repeated and empty slots."""

import pytest
import torch

import importlib

from genome_lm_kernels.dsa import sparse_attention

impl = importlib.import_module("genome_lm_kernels.dsa.sparse_attention")  # the module with the switch

from .conftest import assert_rel_close


def _inputs(T, S, H=3, D=8, Dv=5, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    t = torch.arange(T)[None, :, None]
    idx = (torch.rand(B, T, S, generator=g) * (t + 1)).long()  # causal, random, with repeats
    idx = idx.masked_fill(torch.rand(B, T, S, generator=g) < 0.2, -1)
    idx[:, 5] = -1  # a query with no key at all
    return [x.double().requires_grad_() for x in (q, k, v)], idx


@pytest.mark.parametrize("strategy", ["union", "gather", "gather-subchunks"])
@pytest.mark.parametrize("T,S", [(70, 7), (200, 16)])
def test_strategy_matches_reference(monkeypatch, strategy, T, S):
    if strategy == "union":
        monkeypatch.setattr(impl, "GATHER_ABOVE", 10**9)
    else:
        monkeypatch.setattr(impl, "GATHER_ABOVE", 0)
    if strategy == "gather-subchunks":
        monkeypatch.setattr(impl, "GATHER_ELEMENTS", 3 * 8 * S * 5)  # 5 queries per sub-chunk
    (q, k, v), idx = _inputs(T, S)
    outs = {}
    for backend in ("reference", "torch"):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o, lse = sparse_attention(qq, kk, vv, idx, scale=0.3, backend=backend, chunk=16)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o).double()).sum().backward()
        outs[backend] = (o, lse, qq.grad, kk.grad, vv.grad)
    ref, got = outs["reference"], outs["torch"]
    assert torch.isneginf(got[1][:, 5]).all() and (got[0][:, 5] == 0).all()
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, ref):
        finite = torch.isfinite(b)
        assert_rel_close(a[finite], b[finite], torch.float64, name)


def test_gather_work_does_not_grow_with_T(monkeypatch):
    """The gathered block holds C x S keys per chunk, whatever the sequence length."""
    shapes = []
    original = impl._gather_probs

    def spy(q_CHD, k_CSHD, *args, **kwargs):
        shapes.append(tuple(k_CSHD.shape))
        return original(q_CHD, k_CSHD, *args, **kwargs)

    monkeypatch.setattr(impl, "GATHER_ABOVE", 0)
    monkeypatch.setattr(impl, "_gather_probs", spy)
    for T in (128, 1024):
        (q, k, v), idx = _inputs(T, 16, B=1)
        sparse_attention(q.detach(), k.detach(), v.detach(), idx, scale=0.3, backend="torch", chunk=64)
    assert set(shapes) == {(64, 16, 3, 8)}
