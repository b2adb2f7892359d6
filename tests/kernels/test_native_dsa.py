"""The C sparse attention (cpu/dsa.c) against the fp64 dense reference and the torch path: fresh
random inputs, uneven lengths, repeated / out-of-order / empty slots, both compiled widths
(16, and any other), rows split over threads, outputs poisoned with NaN; and what runs it: the
backend's ``native`` (resolved once), fp64 on the torch path whatever it says."""

import importlib

import pytest
import torch

from genome_lm_kernels.dsa import reference

from .conftest import assert_rel_close

native = importlib.import_module("genome_lm_kernels.cpu.native")
impl = importlib.import_module("genome_lm_kernels.dsa.sparse_attention")



def _case(generator, B, T, S, H, D, Dv, dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=generator).to(dtype)  # noqa: E731
    t = torch.arange(T)[None, :, None]
    idx = (torch.rand(B, T, S, generator=generator) * (t + 1)).long()  # causal, random order, repeats
    idx = idx.masked_fill(torch.rand(B, T, S, generator=generator) < 0.2, -1)
    ascending = torch.rand(B, T, generator=generator) < 0.5  # half the rows in select_tokens' layout
    asc = torch.where(idx >= 0, idx, T + 1).sort(-1).values
    idx = torch.where(ascending[..., None], asc.masked_fill(asc > T, -1), idx)
    idx[:, min(5, T - 1)] = -1  # a query with no key
    return r(B, T, H, D), r(B, T, H, D), r(B, T, H, Dv), idx, r(B, T, H, Dv), torch.randn(B, T, H, generator=generator)


def _grads(fn, q, k, v, do, dlse, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    o, lse = fn(*leaves)
    loss = (o * do.to(o.dtype)).sum() + (lse.nan_to_num(neginf=0.0) * dlse.to(lse.dtype)).sum()
    return (o, lse, *torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("B,T,S,H,D,Dv", [(2, 97, 11, 3, 8, 5), (1, 300, 37, 4, 16, 16), (3, 64, 259, 2, 16, 16),
                                         (2, 1, 3, 1, 4, 4)])
def test_native_matches_reference(generator, nan_poison, monkeypatch, threads, B, T, S, H, D, Dv):
    monkeypatch.setattr(native, "MIN_ROWS_PER_THREAD", 1)  # split even short inputs over the threads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, idx, do, dlse = _case(generator, B, T, S, H, D, Dv)
        got = _grads(lambda *x: impl.sparse_attention(*x, idx, scale=0.3, use_native=True), q, k, v, do, dlse,
                     torch.float32)
        torch_path = _grads(lambda *x: impl.sparse_attention(*x, idx, scale=0.3, use_native=False), q, k, v, do,
                            dlse, torch.float32)
        ref = _grads(lambda *x: reference.sparse_attention(*x, idx, scale=0.3), q, k, v, do, dlse, torch.float64)
    finally:
        torch.set_num_threads(before)
    for name, a, b, c in zip(("o", "lse", "dq", "dk", "dv"), got, ref, torch_path):
        assert a.dtype == torch.float32, name
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), f"{name}: -inf / NaN where the reference has none"
        assert_rel_close(a[finite].double(), b[finite], torch.float32, f"{name} vs reference")
        assert_rel_close(a[finite].double(), c[finite].double(), torch.float32, f"{name} vs torch path")
    assert torch.isneginf(got[1][:, min(5, T - 1)]).all() and (got[0][:, min(5, T - 1)] == 0).all()


def test_native_bf16_inputs(generator, nan_poison):
    """bf16 inputs are computed in fp32 (as the torch path does) and returned in bf16."""
    q, k, v, idx, do, dlse = _case(generator, 2, 130, 17, 2, 16, 16, torch.bfloat16)
    got = _grads(lambda *x: impl.sparse_attention(*x, idx, scale=0.25, use_native=True), q, k, v, do, dlse,
                 torch.bfloat16)
    want = _grads(lambda *x: impl.sparse_attention(*x, idx, scale=0.25, use_native=False), q, k, v, do, dlse,
                  torch.bfloat16)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype, name
        finite = torch.isfinite(b)
        assert_rel_close(a[finite].float(), b[finite].float(), torch.bfloat16, name)


def test_native_repeats_count_once(generator):
    """A row listing every key twice, the first copy descending, gives the row listing it once."""
    q, k, v, idx, do, dlse = _case(generator, 1, 80, 9, 2, 16, 16)
    doubled = torch.cat([idx.flip(-1), idx], dim=-1)
    once = _grads(lambda *x: impl.sparse_attention(*x, idx, scale=0.3, use_native=True), q, k, v, do, dlse,
                  torch.float32)
    twice = _grads(lambda *x: impl.sparse_attention(*x, doubled, scale=0.3, use_native=True), q, k, v, do, dlse,
                   torch.float32)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), once, twice):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_fp64_stays_on_the_torch_path_whatever_the_backend_says(monkeypatch):
    """The C sparse attention runs where ``use_native`` (the backend's ``native``) is on and the
    inputs are not fp64 (the precision reference)."""
    q = torch.randn(1, 20, 2, 8, dtype=torch.float64)
    idx = torch.arange(20)[None, :, None].expand(1, 20, 3).contiguous()
    seen = []
    original = impl.SparseAttention.apply
    monkeypatch.setattr(impl.SparseAttention, "apply", lambda *a: seen.append(a[-1]) or original(*a))
    impl.sparse_attention(q, q, q, idx, scale=0.3, use_native=True)
    impl.sparse_attention(q.float(), q.float(), q.float(), idx, scale=0.3, use_native=True)
    impl.sparse_attention(q.float(), q.float(), q.float(), idx, scale=0.3)
    assert seen == [False, True, False]


# ---------------------------------------------------------------- the dense indexer loss in C

loss_impl = importlib.import_module("genome_lm_kernels.dsa.loss")


def _loss_case(generator, B, T, H, D, Hi, Di, kpool):
    r = lambda *s: torch.randn(*s, generator=generator)  # noqa: E731
    return dict(q_idx_BTHD=r(B, T, Hi, Di), k_idx_BTD=r(B, T, Di), w_BTH=r(B, T, Hi), gate_BTD=r(B, T, Di),
                ape_KD=r(kpool, Di)), (r(B, T, H, D), r(B, T, H, D))


def _loss_and_grads(fn, leaves, dtype):
    xs = {n: x.detach().to(dtype).requires_grad_() for n, x in leaves.items()}
    loss = fn(xs)
    return (loss.detach(), *torch.autograd.grad(loss * 1.7, list(xs.values())))  # a gradient other than 1


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("B,T,H,D,Hi,Di,kpool", [(2, 97, 3, 8, 2, 8, 4), (1, 300, 4, 16, 4, 16, 4),
                                                (2, 130, 2, 16, 3, 16, 3), (3, 70, 1, 16, 9, 16, 1),
                                                (1, 2, 2, 16, 2, 16, 4)])
def test_native_indexer_loss_matches_reference(generator, nan_poison, monkeypatch, threads, B, T, H, D, Hi, Di,
                                               kpool):
    """Loss and the gradients reaching q_idx, k_idx, w, gate and ape (through the pooled keys):
    C (fp32) against the dense reference (fp64) and the torch path (fp32). Widths 16 (the
    vector path, up to 8 heads and past it) and others; kpool 1, 3, 4; T < kpool (no row)."""
    monkeypatch.setattr(native, "MIN_ROWS_PER_THREAD", 1)
    leaves, (q, k) = _loss_case(generator, B, T, H, D, Hi, Di, kpool)

    def run(use_native, backend=None):
        def fn(x):
            args = (x["q_idx_BTHD"], x["k_idx_BTD"], x["w_BTH"], q.to(x["w_BTH"].dtype), k.to(x["w_BTH"].dtype))
            kw = dict(gate_BTD=x["gate_BTD"], ape_KD=x["ape_KD"], kpool=kpool, scale=0.25)
            if backend == "reference":
                return reference.indexer_loss(*args[:3], x["gate_BTD"], x["ape_KD"], *args[3:], None, kpool=kpool,
                                              idx_scale=Di**-0.5, scale=0.25)
            return loss_impl.indexer_loss(*args, **kw, use_native=use_native)
        return fn

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _loss_and_grads(run(True), leaves, torch.float32)
        torch_path = _loss_and_grads(run(False), leaves, torch.float32)
    finally:
        torch.set_num_threads(before)
    if T < kpool:
        assert got[0].item() == 0.0 and all((g == 0).all() for g in got[1:])
        return
    ref = _loss_and_grads(run(None, "reference"), leaves, torch.float64)
    names = ("loss", *leaves)
    for name, a, b, c in zip(names, got, ref, torch_path):
        assert a.dtype == torch.float32, name
        assert_rel_close(a.double().reshape(-1), b.reshape(-1), torch.float32, f"{name} vs reference")
        assert_rel_close(a.reshape(-1), c.reshape(-1), torch.float32, f"{name} vs torch path")


def test_native_indexer_loss_only_where_it_applies(generator, monkeypatch):
    """The C loss takes the dense mode of one process's heads: sparse mode or a reduce_target run
    the torch path even when the backend runs C."""
    leaves, (q, k) = _loss_case(generator, 1, 40, 2, 16, 2, 16, 4)
    args = (leaves["q_idx_BTHD"], leaves["k_idx_BTD"], leaves["w_BTH"], q, k)
    idx = torch.arange(40)[None, :, None].expand(1, 40, 3).contiguous()
    calls = []
    original = loss_impl.NativeDenseIndexerLoss.apply
    monkeypatch.setattr(loss_impl.NativeDenseIndexerLoss, "apply", lambda *a: calls.append(1) or original(*a))
    for kw in (dict(idx_BTS=idx), dict(reduce_target=lambda p, block: p)):
        assert torch.isfinite(loss_impl.indexer_loss(*args, kpool=4, scale=0.25, use_native=True, **kw))
    assert calls == []
    loss_impl.indexer_loss(*args, kpool=4, scale=0.25, use_native=True)
    assert calls == [1]


# ---------------------------------------------------------------- token selection in C

indexer_impl = importlib.import_module("genome_lm_kernels.dsa.indexer")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("levels", [None, 3], ids=["distinct", "many-ties"])
@pytest.mark.parametrize("B,T,Hi,Di,kpool,topk", [(2, 97, 3, 8, 4, 16), (1, 700, 4, 16, 4, 64),
                                                  (2, 200, 2, 16, 3, 31), (1, 90, 2, 16, 1, 5), (2, 3, 2, 16, 4, 8),
                                                  (1, 400, 1, 16, 4, 1000)])
def test_native_select_matches_torch_path(generator, monkeypatch, threads, levels, B, T, Hi, Di, kpool, topk):
    """Slot for slot the torch path's selection (itself checked against the dense reference):
    ties to the lower pool (scores quantised to a few levels make ties at the boundary common),
    rows with fewer visible pools than topk / kpool, the tail pool, T < kpool, kpool 1."""
    monkeypatch.setattr(native, "MIN_ROWS_PER_THREAD", 1)
    r = lambda *s: torch.randn(*s, generator=generator)  # noqa: E731
    q, k, w, gate, ape = r(B, T, Hi, Di), r(B, T, Di), r(B, T, Hi), r(B, T, Di), r(kpool, Di)
    if levels:  # one head, weight 1, keys and queries on a coarse grid: many equal scores
        q, w, gate, ape = q.sign() * 0 + 1, torch.ones(B, T, Hi), None, None
        k = torch.randint(0, levels, (B, T, Di), generator=generator).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, valid = indexer_impl.select_tokens(q, k, w, gate, ape, kpool=kpool, topk=topk, use_native=True)
    finally:
        torch.set_num_threads(before)
    want, _ = indexer_impl.select_tokens(q, k, w, gate, ape, kpool=kpool, topk=topk, use_native=False)
    assert got.dtype == torch.int32 and torch.equal(valid, got >= 0)
    assert torch.equal(got, want), f"{int((got != want).any(-1).sum())} rows differ"


def test_native_select_runs_where_the_backend_says(monkeypatch):
    """fp32 CPU inputs take the C selection when the backend's ``native`` is on (through the
    public op) and not when it is off; fp64 and a custom score_fn never do."""
    from genome_lm_kernels import dsa, resolve_backend

    calls = []
    monkeypatch.setattr(indexer_impl, "native_select",
                        lambda *a, **k: calls.append(1) or torch.zeros(1, 20, 11, dtype=torch.int32))
    q, k, w = torch.randn(1, 20, 2, 8), torch.randn(1, 20, 8), torch.randn(1, 20, 2)
    dsa.select_tokens(q, k, w, kpool=4, topk=8, backend=resolve_backend("torch", "cpu", native=True))
    assert calls == [1]
    dsa.select_tokens(q, k, w, kpool=4, topk=8, backend=resolve_backend("torch", "cpu", native=False))
    indexer_impl.select_tokens(q.double(), k.double(), w.double(), kpool=4, topk=8, use_native=True)
    indexer_impl.select_tokens(q, k, w, kpool=4, topk=8, score_fn=lambda *a: indexer_impl.torch_scores(*a),
                               use_native=True)
    assert calls == [1]
