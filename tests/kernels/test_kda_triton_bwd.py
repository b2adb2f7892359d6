"""The Triton backward of Kimi Delta Attention: every gradient (q, k, v, g, beta, initial state)
against the token-by-token reference and the torch chunked path, on fresh random inputs under
NaN poisoning, with and without an initial state and a final-state gradient, at lengths that are
not multiples of the 64-token chunk, in both precisions (``triton-fp32`` at the fp32 bound,
``triton``'s bf16 tensor-core products at the bf16 bound). Shapes stay small: under
TRITON_INTERPRET the kernels run in numpy."""

from __future__ import annotations

import pytest
import torch

from genome_lm_kernels.kda import kda
from genome_lm_kernels.kda import triton as kda_triton_module

from .conftest import DEVICE, assert_rel_close, backend_of, rel_err
from .test_kda import make_inputs

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread: the reference is many tiny ops


def gradients(x, backend, use_qk_l2norm, w_o, w_S):
    """Gradients of sum(o * w_o) + sum(S * w_S) (either weight may be None: that output unused)."""
    o, S = kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
        output_final_state=True, use_qk_l2norm=use_qk_l2norm, backend=backend_of(backend),
    )
    loss = 0.0
    if w_o is not None:
        loss = loss + (o * w_o.to(o.dtype)).sum()
    if w_S is not None:
        loss = loss + (S * w_S).sum()
    inputs = [t for t in x.values() if t is not None]
    # Without do, q has no path to the loss: its gradient must be (and is compared as) zero.
    grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    return dict(zip([n for n in NAMES if x[n] is not None], grads))


def check_gradients(x, use_qk_l2norm, generator, *, with_do=True, with_dS=True, dtype=torch.float32,
                    backend="triton-fp32"):
    """``dtype`` picks the error bound; gradients must come back in each input's own dtype."""
    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    w_o = torch.randn(B, T, H, V, generator=generator).to(DEVICE) if with_do else None
    w_S = torch.randn(B, H, K, V, generator=generator).to(DEVICE) if with_dS else None
    got = gradients(x, backend, use_qk_l2norm, w_o, w_S)
    x32 = {n: (t.detach().float().requires_grad_() if t is not None else None) for n, t in x.items()}
    want = gradients(x32, "reference", use_qk_l2norm, w_o, w_S)
    errors = {}
    for name in got:
        assert got[name].dtype == x[name].dtype, f"d{name}: dtype {got[name].dtype} != {x[name].dtype}"
        assert_rel_close(got[name], want[name], dtype, f"d{name}")
        errors[name] = rel_err(got[name], want[name])
    return errors


CASES = [  # (B, T, H, K, V, initial state, do, dS, l2norm, decay bound)
    (2, 1, 2, 16, 16, True, True, True, True, 5.0),
    (2, 63, 2, 16, 32, False, True, True, False, 5.0),
    (2, 65, 2, 32, 16, True, True, False, False, 5.0),
    # Weak decay: the initial state and early tokens still matter chunks later.
    (1, 130, 2, 16, 16, True, True, True, True, 0.5),
    (1, 130, 2, 20, 16, False, False, True, False, 0.2),  # K not a power of two; only the final state used
    (1, 65, 2, 16, 16, True, False, True, False, 0.2),  # only the final state used, with S0
]


def case_id(c):
    B, T, H, K, V, s0, do, dS, l2, decay = c
    parts = [f"B{B}-T{T}-H{H}-K{K}-V{V}", "S0" if s0 else "noS0", "do" if do else "nodo",
             "dS" if dS else "nodS", "l2" if l2 else "nol2", f"decay{decay:g}"]
    return "-".join(parts)


@pytest.mark.slow
@pytest.mark.parametrize("B,T,H,K,V,with_state,with_do,with_dS,l2,decay", CASES, ids=[case_id(c) for c in CASES])
def test_triton_backward_matches_reference(
    B, T, H, K, V, with_state, with_do, with_dS, l2, decay, generator, nan_poison
):
    x = make_inputs(B, T, H, K, V, generator, with_state=with_state, normalised_k=not l2, decay=decay)
    check_gradients(x, l2, generator, with_do=with_do, with_dS=with_dS)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[:4], ids=[case_id(c) for c in CASES[:4]])
def test_tensor_core_backward_within_bf16_bound(case, generator, nan_poison):
    B, T, H, K, V, with_state, with_do, with_dS, l2, decay = case
    x = make_inputs(B, T, H, K, V, generator, with_state=with_state, normalised_k=not l2, decay=decay)
    check_gradients(x, l2, generator, with_do=with_do, with_dS=with_dS, dtype=torch.bfloat16, backend="triton")


def test_triton_backward_strong_decay(generator, nan_poison):
    """-60 per token: in-chunk G reaches -4,000; dg needs G's differences kept in fp64 (the exact
    mode) and the e^{G_last - G} k gradient summed without cancelling O(1) terms."""
    x = make_inputs(1, 70, 2, 16, 16, generator, decay=60.0)
    check_gradients(x, True, generator)


@pytest.mark.slow
def test_triton_backward_bf16_inputs(generator, nan_poison):
    """bf16 q, k, v, g, beta, initial state: gradients come back in each input's dtype."""
    x = make_inputs(2, 65, 2, 16, 16, generator, dtype=torch.bfloat16)
    check_gradients(x, True, generator, dtype=torch.bfloat16)
    check_gradients(x, True, generator, dtype=torch.bfloat16, backend="triton")


@pytest.mark.parametrize("with_state", [True, False], ids=["S0", "noS0"])
def test_triton_backward_matches_torch_chunked(with_state, generator, nan_poison):
    """``kda_backward`` against autograd through the torch chunked path, with given cotangents,
    over three chunks, one ragged."""
    from genome_lm_kernels.kda.chunked import kda_chunked

    B, T, H, K, V = 1, 150, 2, 16, 32
    x = make_inputs(B, T, H, K, V, generator, with_state=with_state)
    args = [t.detach() if t is not None else None for t in x.values()]
    q, k, v, g, beta, s0 = args
    do = torch.randn(B, T, H, V, generator=generator).to(DEVICE)
    dS = torch.randn(B, H, K, V, generator=generator).to(DEVICE)
    got = kda_triton_module.kda_backward(q, k, v, g, beta, 0.3, s0, do, dS, exact=True)
    inputs = [t.requires_grad_() if t is not None else None for t in (q, k, v, g, beta, s0)]
    o, S = kda_chunked(*inputs[:5], 0.3, inputs[5])
    want = torch.autograd.grad((o, S), [t for t in inputs if t is not None], (do, dS))
    want = list(want) + ([None] if s0 is None else [])
    for name, a, b in zip(NAMES, got, want):
        if s0 is None and name == "initial_state":
            assert a is None and b is None
            continue
        assert_rel_close(a, b, torch.float32, f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "triton-fp32"])
def test_backward_runs_triton_not_torch(backend, generator, nan_poison, monkeypatch):
    """With the torch chunked path made to raise, forward and backward still run (and match the
    reference): both are the Triton kernels'."""
    from genome_lm_kernels.kda import chunked

    calls = []
    real_backward = kda_triton_module.kda_backward

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton backend called the torch chunked path")

    def counted(*args, **kwargs):
        calls.append(kwargs["exact"])
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(chunked, "kda_chunked", refuse)
    monkeypatch.setattr(kda_triton_module, "kda_backward", counted)
    x = make_inputs(2, 65, 2, 16, 16, generator)
    check_gradients(x, True, generator, backend=backend,
                    dtype=torch.float32 if backend == "triton-fp32" else torch.bfloat16)
    assert calls == [backend == "triton-fp32"]
