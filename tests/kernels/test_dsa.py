"""DSA ops: every fast path (torch, triton) and every gradient against the dense reference."""

from __future__ import annotations

import os

import pytest
import torch

from genome_lm.measure import SampledPeak
from genome_lm_kernels import dsa
from genome_lm_kernels.dsa import loss as loss_module
from genome_lm_kernels.dsa import reference

from .conftest import LENGTHS, REL_TOL, assert_rel_close, backend_of

# (kpool, topk): released checkpoint kpool 4, config default 16; topk not a multiple of kpool;
# topk below kpool (no pool slot: only the tail, so some queries select nothing).
SELECTIONS = [(4, 24), (4, 18), (16, 40), (4, 2)]
SEL_IDS = [f"K{k}-topk{t}" for k, t in SELECTIONS]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
TRITON_LENGTHS = (1, 63, 65)
TRITON_DTYPES = [torch.float32, torch.bfloat16]


def indexer_inputs(generator, B, T, Hi, Di, kpool, dtype, gate=True):
    r = lambda *s: torch.randn(*s, generator=generator).to(dtype)  # noqa: E731
    return dict(q_idx_BTHD=r(B, T, Hi, Di), k_idx_BTD=r(B, T, Di), w_idx_BTH=r(B, T, Hi),
                gate_BTD=r(B, T, Di) if gate else None, ape_KD=r(kpool, Di) if gate else None)


def ref_scores(inp, kpool):
    """Reference pool scores [B, T, N] of the same (possibly low-precision) inputs."""
    B, T, Di = inp["k_idx_BTD"].shape
    gate = inp["gate_BTD"] if inp["gate_BTD"] is not None else inp["k_idx_BTD"].new_zeros(B, T, Di)
    ape = inp["ape_KD"] if inp["ape_KD"] is not None else inp["k_idx_BTD"].new_zeros(kpool, Di)
    kp = reference.pool_keys(inp["k_idx_BTD"], gate, ape, kpool)
    return reference.index_scores(inp["q_idx_BTHD"], kp, inp["w_idx_BTH"], kpool, Di**-0.5)


def assert_same_selection(idx, idx_ref, scores_BTN, *, kpool, topk, sorted_pools=True, rtol=1e-5):
    """Same slot layout, same tails, and the same pool set per query except for pools whose
    scores tie (within rtol of the row's score scale) with the selection boundary."""
    assert idx.shape == idx_ref.shape and idx.dtype == torch.int32  # genome-lm's selections are int32
    idx_ref = idx_ref.to(torch.int32)  # transformers' indexer gives int64
    B, T, N = scores_BTN.shape
    P = min(topk // kpool, N)
    assert torch.equal(idx[..., P * kpool:], idx_ref[..., P * kpool:]), "tail / padding slots differ"
    groups = idx[..., : P * kpool].reshape(B, T, P, kpool)
    first = groups[..., :1]
    expect = torch.where(first >= 0, first + torch.arange(kpool), -1)
    assert torch.equal(groups, expect), "a pool slot is not kpool consecutive tokens of one pool"
    assert bool(((first < 0) | (first % kpool == 0)).all()), "a pool slot does not start on a pool boundary"

    def pool_mask(ix):
        pools = ix[..., : P * kpool : kpool]
        m = torch.zeros(B, T, N + 1, dtype=torch.bool)
        m.scatter_(-1, torch.where(pools >= 0, pools // kpool, N).long(), True)
        return m[..., :N], pools

    mine, pools = pool_mask(idx)
    ref, _ = pool_mask(idx_ref)
    assert torch.equal(mine.sum(-1), ref.sum(-1)), "different number of selected pools"
    assert not (mine & ~torch.isfinite(scores_BTN)).any(), "selected a pool that is not yet complete"
    if sorted_pools:
        nxt = pools[..., 1:]
        assert bool(((nxt < 0) | (nxt > pools[..., :-1])).all()), "pools not ascending / -1 not last"
    diff = mine ^ ref
    if diff.any():
        finite = torch.where(torch.isfinite(scores_BTN), scores_BTN, 0.0)
        scale_BT1 = finite.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        bound_BT1 = torch.where(ref, scores_BTN, float("inf")).amin(-1, keepdim=True)
        gap = ((scores_BTN - bound_BT1).abs() / scale_BT1)[diff]
        assert gap.max() <= rtol, f"{int(diff.sum())} pools differ, worst not a tie: gap {gap.max():.2e}"


# ---------------------------------------------------------------- indexer selection


def _check_selection(backend, T, kpool, topk, dtype, generator, gate=True, chunk=64):
    inp = indexer_inputs(generator, 2, T, 3, 16, kpool, dtype, gate)
    idx, valid = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of(backend), chunk=chunk)
    idx_ref, _ = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of("reference"))
    assert torch.equal(valid, idx >= 0)
    if dtype == torch.float64:  # same arithmetic up to fp64 rounding: identical, ties included
        assert torch.equal(idx, idx_ref)
    assert_same_selection(idx, idx_ref, ref_scores(inp, kpool), kpool=kpool, topk=topk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kpool,topk", SELECTIONS, ids=SEL_IDS)
@pytest.mark.parametrize("T", LENGTHS)
def test_select_tokens_torch(T, kpool, topk, dtype, generator, nan_poison):
    _check_selection("torch", T, kpool, topk, dtype, generator, gate=(T != 65))


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("kpool,topk", SELECTIONS[:3], ids=SEL_IDS[:3])
@pytest.mark.parametrize("T", TRITON_LENGTHS)
def test_select_tokens_triton(T, kpool, topk, dtype, generator, nan_poison):
    _check_selection("triton", T, kpool, topk, dtype, generator, chunk=32)


def test_select_tokens_ties_go_to_the_lower_pool(generator):
    """All scores equal (w = 0): the first topk // kpool visible pools are selected."""
    inp = indexer_inputs(generator, 1, 100, 2, 8, 4, torch.float32)
    inp["w_idx_BTH"] = torch.zeros_like(inp["w_idx_BTH"])
    idx, _ = dsa.select_tokens(**inp, kpool=4, topk=12, backend=backend_of("torch"), chunk=16)
    assert idx[0, 99, :12].tolist() == list(range(12))
    assert idx[0, 99, 12:].tolist() == [-1, -1, -1]  # 100 tokens: pool 24 complete, no tail
    assert idx[0, 50, 12:].tolist() == [48, 49, 50]


@pytest.mark.parametrize("path", ["torch", "torch-no-C", "reference"])
@pytest.mark.parametrize("kpool,topk", SELECTIONS[:3], ids=SEL_IDS[:3])
def test_select_tokens_for_some_queries(path, kpool, topk, generator):
    """Selecting for chunk-aligned ranges of queries (a rank's share of a split selection)
    gives exactly the whole call's rows, on scores with many ties (inputs on 3 levels), and the
    ranges' int32 pools (``seq_len`` = the whole length) are the whole selection's pools."""
    T, chunk = 203, 16
    inp = indexer_inputs(generator, 2, T, 3, 8, kpool, torch.float32)
    inp = {n: None if t is None else (t * 1.5).round().clamp(-1, 1) for n, t in inp.items()}
    if path == "torch-no-C":
        from genome_lm_kernels.dsa import indexer

        def select(**kw):
            return indexer.select_tokens(*inp.values(), kpool=kpool, topk=topk, chunk=chunk, use_native=False,
                                         **kw)[0]
    else:
        def select(**kw):
            return dsa.select_tokens(**inp, kpool=kpool, topk=topk, chunk=chunk, backend=backend_of(path), **kw)[0]
    whole = select()
    ranges = [(0, 16), (48, 203), (16, 48), (32, 33), (192, 203), (96, 96)]
    for q0, q1 in ranges:
        part = select(queries=(q0, q1))
        assert torch.equal(part, whole[:, q0:q1]), (q0, q1)
        pools = dsa.selection_pools(part, kpool=kpool, topk=topk, seq_len=T)
        assert torch.equal(pools, dsa.selection_pools(whole, kpool=kpool, topk=topk)[:, q0:q1])
    for bad in [(8, 40), (0, 204), (32, 16)]:
        with pytest.raises(ValueError, match="multiple of the query chunk"):
            select(queries=bad)


def test_selections_are_int32_and_read_the_same_as_int64(generator):
    """Every path selects int32 token indices (half the memory of int64 for the [B, T, S] index a
    DSA layer holds); the attention and the indexer loss read an int32 index exactly as the same
    index in int64, on the C path, the torch path and the reference."""
    from genome_lm_kernels.dsa import indexer

    T, kpool, topk = 150, 4, 24
    inp = indexer_inputs(generator, 2, T, 3, 8, kpool, torch.float32)
    paths = {p: dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of(p), chunk=32)[0]
             for p in ("torch", "reference")}
    paths["torch-no-C"] = indexer.select_tokens(*inp.values(), kpool=kpool, topk=topk, chunk=32, use_native=False)[0]
    for name, idx in paths.items():
        assert idx.dtype == torch.int32, name
    assert torch.equal(paths["torch"], paths["torch-no-C"])
    idx = paths["torch"]
    assert dsa.selection_tokens(dsa.selection_pools(idx, kpool=kpool, topk=topk), kpool=kpool, topk=topk).dtype \
        == torch.int32
    q, k, v = (torch.randn(2, T, 2, 16, generator=generator) for _ in range(3))
    for path in ("torch", "reference"):
        o32, lse32 = dsa.sparse_attention(q, k, v, idx, scale=0.25, backend=backend_of(path))
        o64, lse64 = dsa.sparse_attention(q, k, v, idx.long(), scale=0.25, backend=backend_of(path))
        assert torch.equal(o32, o64) and torch.equal(lse32, lse64), path
    import importlib

    sparse_module = importlib.import_module("genome_lm_kernels.dsa.sparse_attention")  # the module, not the op

    o32, _ = sparse_module.sparse_attention(q, k, v, idx, scale=0.25, chunk=32, use_native=False)
    o64, _ = sparse_module.sparse_attention(q, k, v, idx.long(), scale=0.25, chunk=32, use_native=False)
    assert torch.equal(o32, o64)
    kw = dict(gate_BTD=inp["gate_BTD"], ape_KD=inp["ape_KD"], kpool=kpool, scale=0.25, backend=backend_of("torch"))
    loss32 = dsa.indexer_loss(inp["q_idx_BTHD"], inp["k_idx_BTD"], inp["w_idx_BTH"], q, k, idx, **kw)
    loss64 = dsa.indexer_loss(inp["q_idx_BTHD"], inp["k_idx_BTD"], inp["w_idx_BTH"], q, k, idx.long(), **kw)
    assert torch.equal(loss32, loss64)


@pytest.mark.parametrize("kpool,topk", SELECTIONS, ids=SEL_IDS)
@pytest.mark.parametrize("T", LENGTHS)
def test_selection_pools_round_trip(T, kpool, topk, generator):
    """A selection kept as int32 pools (across recompute) expands back to the same index, in
    blocks of rows that do not divide T."""
    inp = indexer_inputs(generator, 2, T, 3, 16, kpool, torch.float32)
    idx, _ = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of("torch"), chunk=32)
    pools = dsa.selection_pools(idx, kpool=kpool, topk=topk)
    assert pools.dtype == torch.int32 and pools.shape == (2, T, min(topk // kpool, T // kpool))
    for rows in (7, None):
        assert torch.equal(dsa.selection_tokens(pools, kpool=kpool, topk=topk, rows=rows), idx)


def naive_pick(row: list[float], n_pick: int) -> list[int]:
    """Pools of the n_pick largest finite scores, ties to the lower pool, ascending, -1 padded."""
    order = sorted((p for p, v in enumerate(row) if v > float("-inf")), key=lambda p: (-row[p], p))
    chosen = sorted(order[:n_pick])
    return chosen + [-1] * (n_pick - len(chosen))


@pytest.mark.parametrize("N,n_pick", [(1, 3), (7, 7), (50, 64), (97, 3), (257, 5), (1000, 16), (4099, 64)])
@pytest.mark.parametrize("levels", [None, 3, 40], ids=["continuous", "3-levels", "40-levels"])
def test_pick_pools_matches_a_sort_with_ties_and_invisible_pools(N, n_pick, levels, generator):
    """``pick_pools`` (top-k with the block pre-filter, tied rows re-picked) against sorting
    each row: continuous scores, scores on a few levels (ties everywhere, also across block
    boundaries), ReLU zeros, and -inf (not yet visible) pools at the row ends and inside."""
    from genome_lm_kernels.dsa.indexer import BLOCK, pick_pools

    B, C = 2, 5
    I = torch.randn(B, C, N, generator=generator)
    if levels is not None:
        I = torch.floor(I * levels / 4)
    I = torch.relu(I)  # many exact zeros, as the indexer's ReLU scores have
    visible = torch.randint(0, N + 1, (B, C, 1), generator=generator)
    I = I.masked_fill(torch.arange(N) >= visible, float("-inf"))
    I[0, 0, N // 2] = float("-inf")
    I[1, 1] = float("-inf")  # a query that sees no pool
    got = pick_pools(I.clone(), n_pick)
    want = [[naive_pick(I[b, c].tolist(), n_pick) for c in range(C)] for b in range(B)]
    assert got.tolist() == want
    if N >= 8 * n_pick:
        assert min(BLOCK, N // (4 * n_pick)) >= 2  # the pre-filter ran


# ---------------------------------------------------------------- sparse attention


def attention_case(generator, B, T, H, dtype, kpool=4, topk=18, D=16, DV=8):
    r = lambda *s: torch.randn(*s, generator=generator).to(dtype)  # noqa: E731
    inp = indexer_inputs(generator, B, T, 2, 8, kpool, torch.float64)
    idx, _ = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of("torch"))
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, DV)
    return q, k, v, idx, r(B, T, H, DV), torch.randn(B, T, H, generator=generator)


def _check_attention(backend, T, H, dtype, generator, kpool=4, topk=18, chunk=64):
    q, k, v, idx, do, dlse = attention_case(generator, 2, T, H, dtype, kpool, topk)
    scale = q.shape[-1] ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = dsa.sparse_attention(*leaves, idx, scale=scale, backend=backend_of(backend), chunk=chunk)
    finite = torch.isfinite(lse)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (lse.nan_to_num(neginf=0.0) * dlse).sum(), leaves)

    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = reference.sparse_attention(*ref_leaves, idx, scale=scale)
    ref_grads = torch.autograd.grad(
        (o_ref * do.double()).sum() + (lse_ref.nan_to_num(neginf=0.0) * dlse.double()).sum(), ref_leaves)

    assert o.dtype == dtype
    assert torch.equal(finite, torch.isfinite(lse_ref)), "a query with no key must have lse = -inf"
    assert_rel_close(o, o_ref, dtype, "o")
    assert_rel_close(lse[finite], lse_ref[finite], max(dtype, torch.float32, key=lambda d: REL_TOL[d]), "lse")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype
        assert_rel_close(g, g_ref, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("T", LENGTHS)
def test_sparse_attention_torch(T, H, dtype, generator, nan_poison):
    _check_attention("torch", T, H, dtype, generator)


@pytest.mark.parametrize("kpool,topk", [(16, 40), (4, 2)], ids=["K16-topk40", "K4-topk2-empty-rows"])
def test_sparse_attention_torch_selections(kpool, topk, generator, nan_poison):
    _check_attention("torch", 257, 2, torch.float64, generator, kpool=kpool, topk=topk, chunk=32)


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("T", TRITON_LENGTHS)
def test_sparse_attention_triton(T, dtype, generator, nan_poison):
    _check_attention("triton", T, 2, dtype, generator)


def test_sparse_attention_triton_empty_rows(generator, nan_poison):
    _check_attention("triton", 33, 2, torch.float32, generator, kpool=4, topk=2)


@pytest.mark.slow
def test_sparse_attention_triton_several_blocks(generator, nan_poison):
    """S = 75 slots: two BLOCK_S = 64 blocks, the tail in the second (online-softmax rescaling)."""
    _check_attention("triton", 65, 2, torch.float32, generator, kpool=4, topk=72)


# ---------------------------------------------------------------- indexer loss


def _check_loss(backend, T, kpool, topk, sparse, dtype, generator, chunk=64):
    inp = indexer_inputs(generator, 2, T, 3, 8, kpool, dtype)
    r = lambda *s: torch.randn(*s, generator=generator).to(dtype)  # noqa: E731
    q, k = r(2, T, 2, 16).requires_grad_(), r(2, T, 2, 16).requires_grad_()
    idx = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of("torch"))[0] if sparse else None
    names = list(inp)
    leaves = {n: inp[n].clone().requires_grad_() for n in names}
    loss = dsa.indexer_loss(leaves["q_idx_BTHD"], leaves["k_idx_BTD"], leaves["w_idx_BTH"], q, k, idx,
                            gate_BTD=leaves["gate_BTD"], ape_KD=leaves["ape_KD"], kpool=kpool, scale=0.25,
                            backend=backend_of(backend), chunk=chunk)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names] + [q, k], allow_unused=True)
    assert grads[-1] is None and grads[-2] is None, "the main q, k must not receive indexer-loss gradient"
    ref = {n: inp[n].detach().double().requires_grad_() for n in names}
    loss_ref = dsa.indexer_loss(ref["q_idx_BTHD"], ref["k_idx_BTD"], ref["w_idx_BTH"], q.double(), k.double(),
                                idx, gate_BTD=ref["gate_BTD"], ape_KD=ref["ape_KD"], kpool=kpool, scale=0.25,
                                backend=backend_of("reference"))
    if T < kpool:  # no query sees a complete pool
        assert loss.item() == 0.0
        return
    *ref_grads, gq_ref, gk_ref = torch.autograd.grad(loss_ref, [ref[n] for n in names] + [q, k], allow_unused=True)
    assert gq_ref is None and gk_ref is None, "reference: the main q, k must be detached"
    assert_rel_close(loss.detach().reshape(1), loss_ref.detach().reshape(1), dtype, "loss")
    for n, g, g_ref in zip(names, grads, ref_grads):
        assert_rel_close(g, g_ref, dtype, f"d{n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("kpool,topk", SELECTIONS[:3], ids=SEL_IDS[:3])
@pytest.mark.parametrize("T", LENGTHS)
def test_indexer_loss_torch(T, kpool, topk, sparse, dtype, generator, nan_poison):
    _check_loss("torch", T, kpool, topk, sparse, dtype, generator)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("T", [65, 200])
def test_indexer_loss_recomputed_target(T, sparse, generator, nan_poison, monkeypatch):
    """Backward takes forward's targets when they fit KEEP_TARGET_BYTES and recomputes them
    otherwise (counted: one target per query block, or two); both match the float64 reference.
    (The torch path's logic: the C loss, which fp32 would take, keeps no target.)"""
    monkeypatch.setenv("GENOME_LM_NATIVE", "0")
    blocks = -(-T // 16)
    calls = []
    target = loss_module._target
    monkeypatch.setattr(loss_module, "_target", lambda *a, **k: calls.append(1) or target(*a, **k))
    _check_loss("torch", T, 4, 24, sparse, torch.float32, generator, chunk=16)
    assert len(calls) == blocks, "the targets fit the bound: backward should have kept forward's"
    calls.clear()
    monkeypatch.setattr(loss_module, "KEEP_TARGET_BYTES", 0)
    _check_loss("torch", T, 4, 24, sparse, torch.float32, generator, chunk=16)
    assert len(calls) == 2 * blocks


def test_indexer_loss_target_bytes():
    """The bound is checked against the exact size of the kept blocks (dense: each block's
    visible pools; sparse: the selected ones)."""
    B, T, N, kpool, chunk = 2, 200, 50, 4, 64
    dense = sum((min(t0 + chunk, T) - t0) * min(N, min(t0 + chunk, T) // kpool) for t0 in range(0, T, chunk))
    assert loss_module._target_bytes(B, T, N, None, kpool, chunk, 4) == B * 4 * dense == 2 * 4 * (64 * 16 + 64 * 32
                                                                                               + 64 * 48 + 8 * 50)
    assert loss_module._target_bytes(B, T, N, 27, kpool, chunk, 4) == B * 4 * T * 6  # (27 - 3) // 4 pools


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("T", [65, 257])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_indexer_loss_with_heads_split_over_ranks(T, sparse, keep, generator, nan_poison, monkeypatch):
    """Heads split over two ranks (tensor / context parallel): each rank's loss, its per-head
    target summed with the other rank's by ``reduce_target``, equals the loss over all heads,
    gradients included. The other rank is played by a first pass that records its target
    blocks (forward, then backward's recompute) for the second to add."""
    kpool, topk, chunk = 4, 24, 16
    if not keep:
        monkeypatch.setattr(loss_module, "KEEP_TARGET_BYTES", 0)
    inp = indexer_inputs(generator, 2, T, 3, 8, kpool, torch.float64)
    q, k = (torch.randn(2, T, 5, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    idx = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of("torch"))[0] if sparse else None

    def run(heads, reduce_target):
        leaves = {n: inp[n].clone().requires_grad_() for n in inp}
        loss = dsa.indexer_loss(leaves["q_idx_BTHD"], leaves["k_idx_BTD"], leaves["w_idx_BTH"], q[:, :, heads],
                                k[:, :, heads], idx, gate_BTD=leaves["gate_BTD"], ape_KD=leaves["ape_KD"],
                                kpool=kpool, scale=0.25, backend=backend_of("torch"), chunk=chunk,
                                reduce_target=reduce_target)
        return loss, torch.autograd.grad(loss, list(leaves.values()))

    other = []
    run(slice(3, 5), lambda p, block: other.append(p.clone()) or p)
    blocks = iter(other)
    loss, grads = run(slice(0, 3), lambda p, block: p + next(blocks))
    assert next(blocks, None) is None, "forward and backward used different numbers of target blocks"
    loss_all, grads_all = run(slice(None), None)
    assert_rel_close(loss.detach().reshape(1), loss_all.detach().reshape(1), torch.float64, "loss")
    for g, g_all in zip(grads, grads_all):
        assert_rel_close(g, g_all, torch.float64, "gradient")
    assert abs(run(slice(0, 3), None)[0].item() - loss_all.item()) > 1e-6  # the other heads matter


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_indexer_loss_with_queries_shared_out(sparse, keep, generator, nan_poison, monkeypatch):
    """Query blocks shared out over three ranks (each rank all heads here, so the "sum over
    ranks" is the block itself): each rank's loss covers its own blocks over the whole
    sequence's query count; the three losses and gradients add up to the one-process loss and
    gradients, and a rank that owns no block gets a zero loss and zero gradients."""
    kpool, topk, chunk, T = 4, 24, 16, 150  # 10 blocks, the last one short
    if not keep:
        monkeypatch.setattr(loss_module, "KEEP_TARGET_BYTES", 0)
    inp = indexer_inputs(generator, 2, T, 3, 8, kpool, torch.float64)
    q, k = (torch.randn(2, T, 4, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    idx = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of("torch"))[0] if sparse else None

    def run(owner):
        leaves = {n: inp[n].clone().requires_grad_() for n in inp}
        reduce = None if owner is None else (lambda p, block: p if owner(block) else None)
        loss = dsa.indexer_loss(leaves["q_idx_BTHD"], leaves["k_idx_BTD"], leaves["w_idx_BTH"], q, k, idx,
                                gate_BTD=leaves["gate_BTD"], ape_KD=leaves["ape_KD"], kpool=kpool, scale=0.25,
                                backend=backend_of("torch"), chunk=chunk, reduce_target=reduce)
        return loss.detach(), torch.autograd.grad(loss, list(leaves.values()))

    loss_all, grads_all = run(None)
    owners = [2, 0, 1, 1, 0, 2, 2, 0, 1, 2]  # uneven: rank 2 four blocks, ranks 0 and 1 three
    parts = [run(lambda block, r=r: owners[block] == r) for r in range(3)]
    assert_rel_close(sum(p[0] for p in parts).reshape(1), loss_all.reshape(1), torch.float64, "loss")
    for i, (name, g_all) in enumerate(zip(inp, grads_all)):
        # pool_keys runs the gate's softmax in fp32: its gradients (gate, ape) add up to fp32 precision
        tol = torch.float32 if name in ("gate_BTD", "ape_KD") else torch.float64
        assert_rel_close(sum(p[1][i] for p in parts), g_all, tol, f"gradient of {name}")
    assert all(abs(p[0].item()) > 1e-6 for p in parts)  # every rank's share matters
    idle_loss, idle_grads = run(lambda block: False)
    assert idle_loss.item() == 0.0 and all(not g.any() for g in idle_grads)


# ---------------------------------------------------------------- memory: no [T, T]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_chunked_paths_never_build_T_by_T(generator):
    """At T = 16384 one fp32 [T, T] tensor is 1 GiB; the chunked paths must stay far below."""
    T, kpool, topk, chunk = 16384, 4, 64, 64
    inp = indexer_inputs(generator, 1, T, 2, 16, kpool, torch.float32)
    q, k, v = (torch.randn(1, T, 2, 16, generator=generator).requires_grad_() for _ in range(3))
    tt_bytes = T * T * 4
    with SampledPeak() as m_sel:
        idx, _ = dsa.select_tokens(**inp, kpool=kpool, topk=topk, backend=backend_of("torch"), chunk=chunk)
    with SampledPeak() as m_attn:
        o, lse = dsa.sparse_attention(q, k, v, idx, scale=0.25, backend=backend_of("torch"), chunk=chunk)
        o.sum().backward()
    leaves = [inp[n].requires_grad_() for n in ("q_idx_BTHD", "k_idx_BTD", "w_idx_BTH")]
    with SampledPeak() as m_loss:
        for mode in (None, idx):
            dsa.indexer_loss(*leaves, q, k, mode, kpool=kpool, scale=0.25, backend=backend_of("torch"),
                             chunk=chunk).backward()
    for what, m in (("select", m_sel), ("attention", m_attn), ("loss", m_loss)):
        assert m.delta < tt_bytes / 8, f"{what}: peak growth {m.delta / 2**20:.0f} MiB, [T, T] is 1 GiB"


@pytest.mark.parametrize("name,native", [("reference", False), ("torch", False), ("torch", True)])
def test_select_from_pools_chunk_by_chunk_is_the_whole_selection(generator, name, native):
    """A chunked prefill's selection (``select_from_pools`` over the pooled keys complete so far,
    uneven steps) equals ``select_tokens`` over the whole sequence, on each CPU path."""
    from genome_lm_kernels import resolve_backend

    backend = resolve_backend(name, "cpu", native=native)
    B, T, Hi, Di, kpool, topk = 2, 150, 2, 16, 4, 24
    r = lambda *s: torch.randn(*s, generator=generator)  # noqa: E731
    q, k, w, gate, ape = r(B, T, Hi, Di), r(B, T, Di), r(B, T, Hi), r(B, T, Di), r(kpool, Di)
    whole, _ = dsa.select_tokens(q, k, w, gate, ape, kpool=kpool, topk=topk, backend=backend, chunk=32)
    kp = reference.pool_keys(k, gate, ape, kpool)
    n_pick = min(topk // kpool, kp.shape[1])
    pieces, t0 = [], 0
    for step in (37, 1, 64, 48):
        complete = (t0 + step) // kpool  # the pools the prefill has seen whole by then
        pieces.append(dsa.select_from_pools(q[:, t0:t0 + step], kp[:, :complete], w[:, t0:t0 + step],
                                                kpool=kpool, topk=topk, n_pick=n_pick, t0=t0, backend=backend,
                                                chunk=32))
        t0 += step
    assert t0 == T
    assert torch.equal(torch.cat(pieces, 1).int(), whole.int())
