"""The torch sparse attention gathers each query's own S keys: it matches the dense reference
(forward and every gradient) with repeated, empty and out-of-order slots, counts a repeated key
once, and its per-block work depends on S, H, D only, never on T."""

import importlib

import pytest
import torch

from genome_lm_kernels import dsa
from genome_lm_kernels.dsa import sparse_attention

from .conftest import assert_rel_close, backend_of

impl = importlib.import_module("genome_lm_kernels.dsa.sparse_attention")
loss_impl = importlib.import_module("genome_lm_kernels.dsa.loss")


def _inputs(T, S, H=3, D=8, Dv=5, B=2, seed=0, ascending=False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    t = torch.arange(T)[None, :, None]
    idx = (torch.rand(B, T, S, generator=g) * (t + 1)).long()  # causal, random, with repeats
    if ascending:  # distinct keys, ascending, as select_tokens lays them out
        idx = torch.where(torch.rand(B, T, S, generator=g) < 0.5, idx, -1)
        idx = torch.stack([torch.stack([_ascending_unique(r) for r in row]) for row in idx])
    idx = idx.masked_fill(torch.rand(B, T, S, generator=g) < 0.2, -1)
    idx[:, 5] = -1  # a query with no key at all
    return [x.double() for x in (q, k, v)], idx


def _ascending_unique(row):
    keys = row[row >= 0].unique()
    return torch.cat([keys, row.new_full((row.numel() - keys.numel(),), -1)])


def _run(backend, q, k, v, idx, chunk=16):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = sparse_attention(*leaves, idx, scale=0.3, backend=backend_of(backend), chunk=chunk)
    g = torch.Generator().manual_seed(1)
    (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum().backward()
    return o, lse, *(x.grad for x in leaves)


@pytest.mark.parametrize("ascending", [False, True], ids=["repeats-sorted", "ascending-fast-path"])
@pytest.mark.parametrize("sub_blocks", [False, True])
@pytest.mark.parametrize("dense", [0, 3, 1000], ids=["gather-only", "dense-prefix", "dense-only"])
@pytest.mark.parametrize("T,S", [(70, 7), (200, 16)])
def test_gather_matches_reference(monkeypatch, nan_poison, ascending, sub_blocks, dense, T, S):
    """Gathered blocks, dense blocks (keys 0..t1-1 under a mask) and a mix of both."""
    monkeypatch.setattr(impl, "DENSE_KEYS_PER_SLOT", dense)
    if sub_blocks:  # 5 queries per gathered block instead of the 16 asked for
        monkeypatch.setattr(impl, "GATHER_ELEMENTS", 5 * S * 3 * 8)
    (q, k, v), idx = _inputs(T, S, ascending=ascending)
    got, ref = _run("torch", q, k, v, idx), _run("reference", q, k, v, idx)
    assert torch.isneginf(got[1][:, 5]).all() and (got[0][:, 5] == 0).all()
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, ref):
        finite = torch.isfinite(b)
        assert (torch.isfinite(a) == finite).all(), name
        assert_rel_close(a[finite], b[finite], torch.float64, name)


def test_repeated_key_counts_once():
    """A row listing each key twice (in any order) gives exactly the row listing it once."""
    (q, k, v), idx = _inputs(40, 6, B=1, ascending=True)
    doubled = torch.cat([idx.flip(-1), idx], dim=-1)  # every key twice, the first copy descending
    once, twice = _run("torch", q, k, v, idx), _run("torch", q, k, v, doubled)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), once, twice):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_rows_all_empty():
    """All slots -1: o = 0, lse = -inf, and every gradient 0 (no NaN from the empty softmax)."""
    (q, k, v), idx = _inputs(33, 5, B=2)
    idx[:] = -1
    o, lse, dq, dk, dv = _run("torch", q, k, v, idx)
    assert (o == 0).all() and torch.isneginf(lse).all()
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_own_keys_masks_repeats_in_place():
    idx = torch.tensor([[3, 1, 3, -1, 1, 0], [0, 2, 5, -1, 7, -1], [-1, -1, -1, -1, -1, -1]])
    key, valid = impl.own_keys(idx)
    assert key.tolist() == [[3, 1, 3, 0, 1, 0], [0, 2, 5, 0, 7, 0], [0] * 6]
    assert valid.tolist() == [[True, True, False, False, False, True],
                              [True, True, True, False, True, False], [False] * 6]


@pytest.mark.parametrize("T,kpool,topk", [(1, 4, 8), (37, 4, 8), (300, 4, 64), (300, 16, 64), (257, 1, 5)])
def test_select_tokens_rows_ascending_without_repeats(T, kpool, topk):
    """The fast path's assumption: select_tokens' valid slots are strictly ascending per row
    (complete pools ascending, then the incomplete tail pool), so no key repeats."""
    g = torch.Generator().manual_seed(T)
    idx, valid = dsa.select_tokens(torch.randn(2, T, 2, 8, generator=g), torch.randn(2, T, 8, generator=g),
                                   torch.randn(2, T, 2,
                                               generator=g), kpool=kpool, topk=topk, backend=backend_of("torch"))
    for row in idx.flatten(0, 1):
        keys = row[row >= 0]
        assert (keys[1:] > keys[:-1]).all()
    key, own = impl.own_keys(idx.flatten(0, 1))
    assert torch.equal(own, valid.flatten(0, 1))


def test_gathered_block_depends_on_S_not_T(monkeypatch):
    """Each gathered block is [C, S, H, D] with C from chunk, S, H, D only: same for T = 128
    and T = 1024 (the work per query does not grow with T), and never a T-sized dimension."""
    shapes = []
    original = impl.gather_rows

    def spy(x_TX, key_CS):
        out = original(x_TX, key_CS)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(impl, "gather_rows", spy)
    for T in (128, 1024):
        (q, k, v), idx = _inputs(T, 16, B=1, Dv=8)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        o, _ = sparse_attention(*leaves, idx, scale=0.3, backend=backend_of("torch"), chunk=64)
        o.sum().backward()
    assert set(shapes) == {(64, 16, 3, 8)}
    assert impl.queries_per_block(64, 259, 4, 16) == 64  # the benchmark shape: one 4 MiB block
    assert impl.queries_per_block(64, 2063, 64, 256) == 1  # the full model: one query per block


def test_loss_selected_probs_per_slot():
    """The sparse indexer loss's per-slot target: softmax over the selected key set, summed over
    heads, at each key's first slot (0 on -1 and repeated slots), in slot order."""
    (q, k, _), idx = _inputs(50, 9, B=1)
    q, k, idx = q[0], k[0], idx[0]
    p = loss_impl._selected_probs(q, k, idx, 0.3, torch.float64)
    s = torch.einsum("chd,thd->cht", q, k) * 0.3
    for c in range(idx.shape[0]):
        keys = idx[c][idx[c] >= 0].unique()
        want = torch.zeros(idx.shape[1], dtype=torch.float64)
        if keys.numel():
            probs = s[c][:, keys].softmax(-1).sum(0)
            for j, key in enumerate(keys.tolist()):
                want[(idx[c] == key).nonzero()[0, 0]] = probs[j]
        torch.testing.assert_close(p[c], want, rtol=1e-12, atol=1e-12)
