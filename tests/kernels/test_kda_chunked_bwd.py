"""The torch path's hand-written backward (``kda/chunked_bwd.py``): the forward and every gradient
(q, k, v, g, beta, initial state) against the token-by-token reference in fp64 and against
autograd through the same forward (``kda_chunked_autograd``, which recomputes the preparation
under checkpointing), on fresh random inputs under NaN poisoning; with and without an initial
state and a final-state gradient, at lengths that are not multiples of the 64-token chunk; a
strong-decay case (the exact pairwise form); gradcheck in fp64; the saved tensors' size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genome_lm_kernels.kda import chunked
from genome_lm_kernels.kda.chunked import kda_chunked, kda_chunked_autograd
from genome_lm_kernels.kda.reference import kda_reference

from .conftest import LENGTHS, assert_rel_close

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
SCALE = 0.3


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread: the reference is many tiny ops


def make_inputs(B, T, H, K, V, generator, *, with_state=True, decay=5.0, dtype=torch.float32):
    """q, k (unit length, as after the op's l2norm), v, g = -decay * sigmoid(x), beta = sigmoid(x)."""

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x = {
        "q": randn(B, T, H, K), "k": F.normalize(randn(B, T, H, K), dim=-1), "v": randn(B, T, H, V),
        "g": -decay * torch.sigmoid(randn(B, T, H, K)), "beta": torch.sigmoid(randn(B, T, H)),
        "initial_state": randn(B, H, K, V) if with_state else None,
    }
    return {n: (t.to(dtype).requires_grad_() if t is not None else None) for n, t in x.items()}


def run_with_grads(fn, x, w_o, w_S):
    """(o, final state, gradients of sum(o * w_o) + sum(S * w_S) for each input given); w_S None:
    the final state is unused."""
    o, S = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["initial_state"])
    loss = (o * w_o.to(o.dtype)).sum() + (0.0 if w_S is None else (S * w_S.to(S.dtype)).sum())
    inputs = [t for t in x.values() if t is not None]
    return o, S, torch.autograd.grad(loss, inputs)


def check_backward(x, generator):
    """The hand-written backward against the fp64 token loop and against autograd's backward
    through the same forward, with random cotangents (the final state's in half the cases)."""
    names = [n for n in NAMES if x[n] is not None]
    B, T, H, V = x["v"].shape
    K = x["k"].shape[-1]
    w_o = torch.randn(B, T, H, V, generator=generator, dtype=torch.float64)
    w_S = torch.randn(B, H, K, V, generator=generator, dtype=torch.float64) if x.pop("final_grad") else None
    o, S, grads = run_with_grads(kda_chunked, x, w_o, w_S)
    o_ag, S_ag, grads_ag = run_with_grads(kda_chunked_autograd, x, w_o, w_S)
    fp64 = {n: (t.detach().double().requires_grad_() if t is not None else None) for n, t in x.items()}
    o_ref, S_ref, grads_ref = run_with_grads(kda_reference, fp64, w_o, w_S)
    # one forward, two backwards: the outputs are the autograd path's, bit for bit
    assert torch.equal(o, o_ag) and torch.equal(S, S_ag)
    assert_rel_close(o, o_ref, torch.float32, "o")
    assert_rel_close(S, S_ref, torch.float32, "final state")
    for name, got, autograd, ref in zip(names, grads, grads_ag, grads_ref):
        assert_rel_close(got, ref, torch.float32, f"d{name} vs the fp64 reference")
        assert_rel_close(got, autograd, torch.float32, f"d{name} vs autograd")


# (initial state, final-state gradient), cycled over the lengths: every length, every variant,
# without the full product (the token loop at T = 1000 costs a second per call)
VARIANTS = [(True, True), (False, True), (True, False), (False, False), (True, True)]


@pytest.mark.parametrize(
    "T,with_state,final_grad", [(T, *v) for T, v in zip(LENGTHS, VARIANTS)],
    ids=[f"B2-T{T}-H2-{'S0' if v[0] else 'noS0'}-{'dS' if v[1] else 'nodS'}" for T, v in zip(LENGTHS, VARIANTS)],
)
def test_backward_matches_reference_and_autograd(T, with_state, final_grad, generator, nan_poison):
    x = make_inputs(2, T, 2, 16, 32, generator, with_state=with_state)
    check_backward(dict(x, final_grad=final_grad), generator)


def test_strong_decay_backward(generator, nan_poison):
    """Decays down to -60 per token take the exact pairwise form (``_sums_exact``)."""
    x = make_inputs(1, 257, 2, 16, 16, generator, decay=60.0)
    G = x["g"].detach().view(1, -1, 2, 16)[:, :256].unflatten(1, (4, 64)).double().cumsum(2)
    assert chunked.needs_exact(G.permute(0, 3, 1, 2, 4).reshape(-1, 64, 16))
    check_backward(dict(x, final_grad=True), generator)


def test_several_groups_carry_the_gradient(generator, nan_poison, monkeypatch):
    """Groups of 2 chunks (one ragged): the state's gradient crosses four autograd nodes."""
    monkeypatch.setattr(chunked, "GROUP", 2 * 2 * 2)
    x = make_inputs(2, 400, 2, 16, 16, generator)
    check_backward(dict(x, final_grad=True), generator)


@pytest.mark.slow
@pytest.mark.parametrize("decay", [1.0, 60.0], ids=["split", "exact"])
def test_gradcheck_fp64(decay, generator, monkeypatch):
    """Finite differences in fp64 on a tiny case (two chunks, one partial), every Jacobian entry
    (fast_mode's one random projection let a 0.1% error in dk through). The path casts to fp32
    with ``.float()``; made the identity here, the same code runs in fp64 end to end."""
    monkeypatch.setattr(torch.Tensor, "float", lambda self: self)
    x = make_inputs(1, 70, 1, 4, 4, generator, decay=decay, dtype=torch.float64)
    inputs = tuple(x[n] for n in NAMES)

    def fn(*args):
        return kda_chunked(*args[:5], SCALE, args[5])

    assert kda_chunked(*inputs[:5], SCALE, inputs[5])[0].dtype == torch.float64
    assert torch.autograd.gradcheck(fn, inputs, atol=1e-7, rtol=1e-5)


def test_saved_tensors_stay_bounded(generator):
    """What the backward keeps: the inputs in fp32 (q, k, g: 3K floats per (token, head), v: V,
    beta: 1), W (K), U (V), M and the UT transform (2 x 64), and one entering state per chunk
    (K V / 64); nothing of the pairwise temporaries."""
    B, T, H, K, V = 1, 1000, 2, 16, 32
    x = make_inputs(B, T, H, K, V, generator)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["initial_state"])
    rows = B * H * 1024  # (token, head) pairs after padding to whole chunks
    expected = rows * (4 * K + 2 * V + 1 + 2 * 64 + K * V / 64) * 4
    assert sum(storages.values()) == expected
