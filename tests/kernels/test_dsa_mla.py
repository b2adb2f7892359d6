"""Sparse attention over a shared latent (absorbed MLA): the torch path and both Triton precisions
against the dense reference, forward and every gradient, on fresh random inputs under NaN
poisoning; and the absorbed form against the per-head form it replaces."""

from __future__ import annotations

import pytest
import torch

from genome_lm_kernels import dsa
from genome_lm_kernels.dsa import mla as mla_module
from genome_lm_kernels.dsa import reference

from .conftest import REL_TOL, assert_rel_close, backend_of
from .test_dsa import indexer_inputs


def mla_case(generator, B, T, H, D, dv, dtype, kpool=4, topk=18):
    r = lambda *s: torch.randn(*s, generator=generator).to(dtype)  # noqa: E731
    idx, _ = dsa.select_tokens(**indexer_inputs(generator, B, T, 2, 8, kpool, torch.float64),
                               kpool=kpool, topk=topk, backend=backend_of("torch"))
    return r(B, T, H, D), r(B, T, D), idx, r(B, T, H, dv), torch.randn(B, T, H, generator=generator)


def check_mla(backend, T, H, D, dv, dtype, generator, *, bound=None, kpool=4, topk=18, chunk=16):
    """o, lse, dq, dkv against the fp64 reference on the same (possibly bf16) values."""
    bound = bound or dtype
    q, kv, idx, do, dlse = mla_case(generator, 2, T, H, D, dv, dtype, kpool, topk)
    scale = D**-0.5
    leaves = [x.clone().requires_grad_() for x in (q, kv)]
    o, lse = dsa.sparse_mla(*leaves, idx, scale=scale, dv=dv, backend=backend_of(backend), chunk=chunk)
    finite = torch.isfinite(lse)
    loss = (o.float() * do.float()).sum() + (lse.nan_to_num(neginf=0.0) * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, kv)]
    o_ref, lse_ref = dsa.sparse_mla(*ref_leaves, idx, scale=scale, dv=dv, backend=backend_of("reference"))
    ref_loss = (o_ref * do.double()).sum() + (lse_ref.nan_to_num(neginf=0.0) * dlse.double()).sum()
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves)
    assert o.dtype == dtype and o.shape == (2, T, H, dv)
    assert torch.equal(finite, torch.isfinite(lse_ref)), "a query with no key must have lse = -inf"
    assert bool((o[~finite] == 0).all()), "a query with no key must have o = 0"
    assert_rel_close(o, o_ref, bound, "o")
    assert_rel_close(lse[finite], lse_ref[finite], max(bound, torch.float32, key=lambda d: REL_TOL[d]), "lse")
    for name, g, g_ref in zip(("dq", "dkv"), grads, ref_grads):
        assert g.dtype == dtype
        assert_rel_close(g, g_ref, bound, name)


@pytest.mark.parametrize("dense_keys", [8, 0], ids=["dense-blocks", "gathered-blocks"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 63, 257])
def test_torch_matches_reference(T, dtype, dense_keys, generator, nan_poison, monkeypatch):
    monkeypatch.setattr(mla_module, "DENSE_KEYS_PER_SLOT", dense_keys)
    check_mla("torch", T, 3, 16, 8, dtype, generator)


def test_torch_counts_a_repeated_key_once(generator, nan_poison, monkeypatch):
    """As the reference does (a dense mask): the slots list key 0 three times."""
    monkeypatch.setattr(mla_module, "DENSE_KEYS_PER_SLOT", 0)
    q, kv, idx, *_ = mla_case(generator, 1, 40, 2, 8, 8, torch.float64)
    idx[..., :3] = 0
    o, lse = dsa.sparse_mla(q, kv, idx, scale=0.3, dv=8, backend=backend_of("torch"))
    o_ref, lse_ref = dsa.sparse_mla(q, kv, idx, scale=0.3, dv=8, backend=backend_of("reference"))
    assert_rel_close(o, o_ref, torch.float64, "o")


@pytest.mark.parametrize("kpool,topk", [(4, 2), (16, 40)], ids=["K4-topk2-empty-rows", "K16-topk40"])
def test_torch_selections(kpool, topk, generator, nan_poison, monkeypatch):
    monkeypatch.setattr(mla_module, "DENSE_KEYS_PER_SLOT", 0)
    check_mla("torch", 130, 2, 16, 16, torch.float64, generator, kpool=kpool, topk=topk)


TRITON_CASES = [(1, 2, 16, 16), (63, 3, 32, 16), (65, 20, 32, 32)]  # (T, H, D, dv): 20 heads = two head blocks


@pytest.mark.parametrize("T,H,D,dv", TRITON_CASES, ids=[f"T{c[0]}-H{c[1]}-D{c[2]}-dv{c[3]}" for c in TRITON_CASES])
def test_triton_fp32_matches_reference(T, H, D, dv, generator, nan_poison):
    check_mla("triton-fp32", T, H, D, dv, torch.float32, generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,H,D,dv", TRITON_CASES, ids=[f"T{c[0]}-H{c[1]}-D{c[2]}-dv{c[3]}" for c in TRITON_CASES])
def test_triton_tensor_cores_within_bf16_bound(T, H, D, dv, dtype, generator, nan_poison):
    """bf16 products (fp32 accumulation): the bf16 bound, for fp32 and bf16 inputs alike."""
    check_mla("triton", T, H, D, dv, dtype, generator, bound=torch.bfloat16)


@pytest.mark.slow
def test_triton_empty_rows_and_several_slot_blocks(generator, nan_poison):
    """topk 2: queries with no key (lse -inf, o 0); topk 72: 75 slots over several BS blocks."""
    check_mla("triton-fp32", 33, 2, 16, 16, torch.float32, generator, topk=2)
    check_mla("triton-fp32", 130, 2, 16, 16, torch.float32, generator, topk=72)


def test_rejects_values_wider_than_the_latent(generator):
    q, kv, idx, *_ = mla_case(generator, 1, 8, 2, 16, 16, torch.float32)
    for backend in ("reference", "torch", "triton"):
        with pytest.raises(ValueError, match="dv <= D"):
            dsa.sparse_mla(q, kv, idx, scale=0.3, dv=32, backend=backend_of(backend))


@pytest.mark.slow
@pytest.mark.parametrize("backend,bound", [("torch", torch.float64), ("triton-fp32", torch.float32),
                                           ("triton", torch.bfloat16)], ids=["torch", "triton-fp32", "triton"])
def test_absorbing_inside_the_op(backend, bound, generator, nan_poison, monkeypatch):
    """w_uk given: q is per head [B, T, H, E] and the op forms q W_UK itself (again in backward);
    o, lse and the gradients of q, W_UK and kv equal the reference on the absorbed query."""
    monkeypatch.setattr(mla_module, "DENSE_KEYS_PER_SLOT", 0)
    dtype = torch.float64 if backend == "torch" else torch.float32
    B, T, H, E, D, dv = 2, 130, 3, 8, 16, 16
    q, kv, idx, do, _ = mla_case(generator, B, T, H, D, dv, dtype)
    q = torch.randn(B, T, H, E, generator=generator, dtype=dtype)
    w = torch.randn(H, E, D, generator=generator, dtype=dtype) / E**0.5
    leaves = [x.clone().requires_grad_() for x in (q, w, kv)]
    o, lse = dsa.sparse_mla(leaves[0], leaves[2], idx, scale=0.3, dv=dv, backend=backend_of(backend),
                            w_uk_HED=leaves[1])
    grads = torch.autograd.grad((o * do).sum() + lse.nan_to_num(neginf=0.0).sum(), leaves)
    ref = [x.detach().double().requires_grad_() for x in (q, w, kv)]
    o_ref, lse_ref = dsa.sparse_mla(torch.einsum("bthe,hed->bthd", ref[0], ref[1]), ref[2], idx, scale=0.3, dv=dv,
                                    backend=backend_of("reference"))
    ref_grads = torch.autograd.grad((o_ref * do.double()).sum() + lse_ref.nan_to_num(neginf=0.0).sum(), ref)
    assert_rel_close(o, o_ref, bound, "o")
    for name, g, g_ref in zip(("dq", "dw_uk", "dkv"), grads, ref_grads):
        assert_rel_close(g, g_ref, bound, name)


def test_indexer_loss_absorbs_per_block(generator):
    """The loss with per-head q and W_UK equals the loss on q W_UK against the shared latent."""
    B, T, H, E, D, kpool = 1, 150, 3, 8, 16, 4
    inp = indexer_inputs(generator, B, T, 2, 8, kpool, torch.float64)
    idx, _ = dsa.select_tokens(**inp, kpool=kpool, topk=16, backend=backend_of("torch"))
    q = torch.randn(B, T, H, E, generator=generator, dtype=torch.float64)
    w = torch.randn(H, E, D, generator=generator, dtype=torch.float64)
    kv = torch.randn(B, T, 1, D, generator=generator, dtype=torch.float64)
    for mode_idx in (None, idx):
        kwargs = dict(gate_BTD=inp["gate_BTD"], ape_KD=inp["ape_KD"], kpool=kpool, scale=0.3,
                      backend=backend_of("torch"), chunk=32)
        args = (inp["q_idx_BTHD"], inp["k_idx_BTD"], inp["w_idx_BTH"])
        got = dsa.indexer_loss(*args, q, kv, mode_idx, w_uk_HED=w, **kwargs)
        want = dsa.indexer_loss(*args, torch.einsum("bthe,hed->bthd", q, w), kv.expand(B, T, H, D), mode_idx, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_absorbed_equals_per_head_attention(generator):
    """The reason for the op: with k_h = W_UK[h] c and v_h = W_UV[h] c, attention over the latent
    with qa_h = W_UK[h]^T q_h, then W_UV[h], is the per-head attention (``sparse_attention``)."""
    B, T, H, Dc, dqk, dv = 1, 90, 3, 24, 16, 8
    r = lambda *s: torch.randn(*s, generator=generator, dtype=torch.float64)  # noqa: E731
    c, q, W_UK, W_UV = r(B, T, Dc), r(B, T, H, dqk), r(H, dqk, Dc), r(H, dv, Dc)
    idx, _ = dsa.select_tokens(**indexer_inputs(generator, B, T, 2, 8, 4, torch.float64), kpool=4, topk=18,
                               backend=backend_of("torch"))
    k = torch.einsum("hdc,btc->bthd", W_UK, c)
    v = torch.einsum("hdc,btc->bthd", W_UV, c)
    o_heads, lse_heads = reference.sparse_attention(q, k, v, idx, scale=0.25)
    qa = torch.einsum("bthd,hdc->bthc", q, W_UK)
    o_lat, lse_lat = dsa.sparse_mla(qa, c, idx, scale=0.25, dv=Dc, backend=backend_of("torch"))
    o_abs = torch.einsum("bthc,hdc->bthd", o_lat, W_UV)
    assert_rel_close(o_abs, o_heads, torch.float64, "o")
    assert_rel_close(lse_lat, lse_heads, torch.float64, "lse")
