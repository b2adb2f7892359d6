"""Kimi Delta Attention: every fast path (forward, final state, every gradient) against the
token-by-token reference, on fresh random inputs, under NaN poisoning."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from genome_lm_kernels.kda import kda, l2norm
from genome_lm_kernels.kda.reference import kda_reference

from .conftest import DEVICE, LENGTHS, assert_rel_close, backend_of

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture(autouse=True)
def one_thread():
    """The reference is thousands of tiny ops; with OpenMP's 2 threads on a busy 2-core machine its
    backward ran 50x slower (spinning threads). One thread here, restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(B, T, H, K, V, generator, *, dtype=torch.float32, with_state=True, normalised_k=True, decay=5.0):
    """Random KDA inputs: g = -decay * sigmoid(x) (glm5_next's safe gate with lower bound -decay),
    beta = sigmoid(x). Without the op's own l2norm, k must come normalised or the delta rule
    (I - beta k k^T) blows up over long sequences."""

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE)

    k = randn(B, T, H, K)
    x = dict(
        q=randn(B, T, H, K),
        k=F.normalize(k, dim=-1) if normalised_k else k,
        v=randn(B, T, H, V),
        g=-decay * torch.sigmoid(randn(B, T, H, K)),
        beta=torch.sigmoid(randn(B, T, H)),
        initial_state=randn(B, H, K, V) if with_state else None,
    )
    return {n: (t.to(dtype).requires_grad_() if t is not None else None) for n, t in x.items()}


# The torch backend's two CPU paths: the token recurrence in C (cpu/kda.c, heads of up to 64 x 64
# floats) and the chunked torch path (GENOME_LM_NATIVE=0, and the full model's heads).
CPU_PATHS = ("torch-C", "torch-chunked")


@contextlib.contextmanager
def cpu_path(name: str | None):
    """Run the torch backend on the CPU path ``name`` (a CPU_PATHS entry without "torch-"), and
    check that it is the one that ran; None: leave the choice alone."""
    from genome_lm_kernels.kda import native as native_kda

    if name is None:
        yield
        return
    ran, apply, before = [], native_kda._KDA.apply, os.environ.get("GENOME_LM_NATIVE")
    os.environ["GENOME_LM_NATIVE"] = "1" if name == "C" else "0"
    native_kda._KDA.apply = lambda *a: ran.append(1) or apply(*a)
    try:
        yield
    finally:
        native_kda._KDA.apply = apply
        if before is None:
            os.environ.pop("GENOME_LM_NATIVE")
        else:
            os.environ["GENOME_LM_NATIVE"] = before
    assert bool(ran) == (name == "C"), f"the {name} path did not run"


def run(x, backend, use_qk_l2norm):
    path = None
    if backend in CPU_PATHS:
        backend, path = "torch", backend.removeprefix("torch-")
    with cpu_path(path):
        return kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"],
            initial_state=x["initial_state"], output_final_state=True,
            use_qk_l2norm=use_qk_l2norm, backend=backend_of(backend),
        )


def check_against_reference(x, backend, use_qk_l2norm, dtype, generator, grads=True):
    o, S = run(x, backend, use_qk_l2norm)
    # The reference runs on the same values upcast to fp32 and keeps its fp32 output, so a bf16
    # check also counts the fast path's rounding of o.
    o_ref, S_ref = run({n: (t.float() if t is not None else None) for n, t in x.items()}, "reference", use_qk_l2norm)
    assert o.dtype == x["q"].dtype and S.dtype == torch.float32
    assert_rel_close(o, o_ref, dtype, "o")
    assert_rel_close(S, S_ref, dtype, "final state")
    if not grads:
        return
    # Random cotangents for o and the final state, so every path into every input is exercised.
    w_o = torch.randn(o.shape, generator=generator).to(o)
    w_S = torch.randn(S.shape, generator=generator).to(S)
    inputs = [t for t in x.values() if t is not None]
    got = torch.autograd.grad((o * w_o).sum() + (S * w_S).sum(), inputs)
    want = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_S).sum(), inputs)
    for name, a, b in zip([n for n in NAMES if x[n] is not None], got, want):
        assert_rel_close(a, b, dtype, f"d{name}")


VARIANTS = [(True, True), (False, False), (True, False), (False, True)]  # (initial state, l2norm)


def variant_id(v):
    return f"{'S0' if v[0] else 'noS0'}-{'l2' if v[1] else 'nol2'}"


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("B,T,H", [(2, T, 3) for T in LENGTHS], ids=[f"B2-T{T}-H3" for T in LENGTHS])
def test_torch_matches_reference_fp32(B, T, H, variant, path, generator, nan_poison):
    with_state, l2 = variant
    x = make_inputs(B, T, H, 16, 32, generator, with_state=with_state, normalised_k=not l2)
    check_against_reference(x, path, l2, torch.float32, generator)


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("T", LENGTHS, ids=lambda T: f"B2-T{T}-H3")
def test_torch_matches_reference_bf16_forward(T, path, generator, nan_poison):
    x = make_inputs(2, T, 3, 16, 32, generator, dtype=torch.bfloat16)
    check_against_reference(x, path, True, torch.bfloat16, generator, grads=False)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("K,V", [(16, 16), (8, 12), (64, 64)])
def test_c_recurrence_other_heads_and_threads(K, V, threads, generator, nan_poison, monkeypatch):
    """The C recurrence on the compiled 16 x 16 heads and on others (up to MAX_STATE), its (batch,
    head) rows split over threads; 3 x 2 rows so that a thread holds several."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x = make_inputs(3, 131, 2, K, V, generator)
    check_against_reference(x, "torch-C", True, torch.float32, generator)


def test_c_recurrence_only_where_it_applies(generator, monkeypatch):
    """Heads above MAX_STATE and fp64 inputs take the chunked path; without gradients the C
    forward keeps no block states."""
    from genome_lm_kernels.kda import native as native_kda

    calls = []
    monkeypatch.setattr(native_kda._KDA, "apply", lambda *a, f=native_kda._KDA.apply: calls.append(a) or f(*a))
    big = make_inputs(1, 5, 1, 128, 64, generator)
    assert big["q"].shape[-1] * big["v"].shape[-1] > native_kda.MAX_STATE
    run(big, "torch", True)
    run({n: (t.double() if t is not None else None) for n, t in make_inputs(1, 5, 1, 16, 16, generator).items()},
        "torch", True)
    assert calls == []
    with torch.no_grad():
        run(make_inputs(1, 5, 1, 16, 16, generator), "torch-C", True)


TRITON_CASES = [  # (B, T, H, K, V, initial state, l2norm): the interpreter is slow, keep it small
    (2, 1, 2, 16, 16, True, True),
    (2, 63, 2, 16, 32, False, False),
    (2, 65, 2, 32, 16, True, False),
    (1, 130, 3, 20, 16, False, True),  # K not a power of two: masked lanes
]
# The tensor-core mode rounds every matrix product's operands to bf16 (fp32 accumulation and
# state): against the fp32 reference it is held to the bf16 bound whatever the input dtype.
# Measured under the interpreter (bf16 rounding emulated exactly): 0.6e-2 to 1.2e-2.
PRECISIONS = [("triton-fp32", torch.float32), ("triton", torch.bfloat16)]


@pytest.mark.slow
@pytest.mark.parametrize("backend,bound", PRECISIONS, ids=[p[0] for p in PRECISIONS])
@pytest.mark.parametrize(
    "B,T,H,K,V,with_state,l2", TRITON_CASES,
    ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-{variant_id(c[5:])}" for c in TRITON_CASES],
)
def test_triton_matches_reference(B, T, H, K, V, with_state, l2, backend, bound, generator, nan_poison):
    x = make_inputs(B, T, H, K, V, generator, with_state=with_state, normalised_k=not l2)
    check_against_reference(x, backend, l2, bound, generator)


@pytest.mark.slow
def test_triton_matches_reference_bf16_inputs(generator, nan_poison):
    x = make_inputs(2, 65, 2, 16, 16, generator, dtype=torch.bfloat16)
    check_against_reference(x, "triton", True, torch.bfloat16, generator)


def test_triton_fp32_is_tighter_than_bf16(generator):
    """The two precisions are different arithmetic: the fp32 mode within 1e-6 of the reference,
    the tensor-core mode above it (its bf16 operands show), so neither silently runs the other."""
    from .conftest import rel_err

    x = make_inputs(1, 130, 2, 16, 16, generator)
    o_ref, _ = run({n: (t.detach() if t is not None else None) for n, t in x.items()}, "reference", True)
    err = {b: rel_err(run(x, b, True)[0].detach(), o_ref) for b in ("triton-fp32", "triton")}
    assert err["triton-fp32"] < 1e-6 < 1e-3 < err["triton"] < 2e-2, err


@pytest.mark.parametrize("backend,T", [("torch-C", 257), ("torch-chunked", 257), ("triton-fp32", 70)],
                         ids=["torch-C-B2-T257-H2", "torch-chunked-B2-T257-H2", "triton-fp32-B1-T70-H2"])
def test_strong_decay_stays_finite_and_exact(backend, T, generator, nan_poison):
    """Unbounded gates (-exp(A_log) * softplus) can decay by e^-60 per token: the in-chunk
    decay products span e^-3840, which a naive e^{G_i} e^{-G_j} split would overflow."""
    x = make_inputs(2 if backend.startswith("torch") else 1, T, 2, 16, 16, generator, decay=60.0)
    check_against_reference(x, backend, True, torch.float32, generator)


@pytest.mark.parametrize("group", [1, 2], ids=lambda n: f"group{n}")
def test_torch_streams_groups_of_chunks(group, generator, nan_poison, monkeypatch):
    """The torch path prepares and checkpoints groups of GROUP chunks (128 by default: more than
    the other tests reach); shrink it so several groups, one ragged, carry the state."""
    from genome_lm_kernels.kda import chunked

    monkeypatch.setattr(chunked, "GROUP", group * 2 * 3)
    x = make_inputs(2, 257, 3, 16, 32, generator)
    check_against_reference(x, "torch-chunked", True, torch.float32, generator)


def test_decay_at_the_factorised_limit(generator, nan_poison):
    """The torch path's fast pairwise split (chunked.MAX_EXP) at its limit: factors up to e^59,
    large queries; the entries above the diagonal overflow and must not leak inf/NaN."""
    from genome_lm_kernels.kda.chunked import MAX_EXP, SUB

    x = make_inputs(2, 200, 2, 16, 16, generator)
    x["g"] = torch.full_like(x["g"], -0.99 * MAX_EXP / (SUB // 2)).requires_grad_()
    x["q"] = (10 * x["q"]).detach().requires_grad_()
    check_against_reference(x, "torch-chunked", False, torch.float32, generator)


@pytest.mark.parametrize("backend,T,split", [("torch-C", 300, 100), ("torch-chunked", 300, 100), ("triton-fp32", 80,
                                                                                                  33)],
                         ids=["torch-C-B2-T300-H2", "torch-chunked-B2-T300-H2", "triton-fp32-B2-T80-H2"])
def test_streaming_equals_one_call(backend, T, split, generator, nan_poison):
    """Two calls, the first's final state as the second's initial state, equal one call."""
    x = make_inputs(2, T, 2, 16, 16, generator)
    whole_o, whole_S = run(x, backend, True)
    first = {n: (t[:, :split] if n != "initial_state" else t) for n, t in x.items()}
    second = {n: (t[:, split:] if n != "initial_state" else None) for n, t in x.items()}
    o1, S1 = run(first, backend, True)
    second["initial_state"] = S1
    o2, S2 = run(second, backend, True)
    assert_rel_close(torch.cat([o1, o2], 1), whole_o, torch.float32, "o")
    assert_rel_close(S2, whole_S, torch.float32, "final state")


def test_defaults_follow_glm5_next(generator):
    """scale defaults to K**-0.5; l2norm is x / sqrt(sum x^2 + 1e-6) in fp32; no final state
    unless asked."""
    x = make_inputs(1, 10, 2, 16, 16, generator, normalised_k=False, with_state=False)
    o, S = kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=True, backend=backend_of("torch"))
    assert S is None
    q, k = l2norm(x["q"]), l2norm(x["k"])
    assert torch.allclose(q.norm(dim=-1), torch.ones(()), atol=1e-5)
    o_ref, _ = kda_reference(q, k, x["v"], x["g"], x["beta"], 16**-0.5)
    assert_rel_close(o, o_ref, torch.float32, "o")


def test_rejects_bad_backend_and_shapes(generator, monkeypatch):
    from genome_lm_kernels import resolve_backend

    x = make_inputs(1, 4, 2, 16, 16, generator, with_state=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="unknown kernel backend"):
        resolve_backend("cuda", DEVICE)
    with pytest.raises(TypeError, match=r"kda\(\) takes a resolved backend.*resolve_backend\('torch'"):
        kda(*args, backend="torch")  # a name is resolved once, by the caller, never inside an op
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        for name in ("triton", "triton-fp32"):
            with pytest.raises(ValueError, match="needs a CUDA device"):
                resolve_backend(name, DEVICE)
    if DEVICE.type == "cpu":  # fla-core's kernels need a GPU, interpreter or not
        with pytest.raises(ValueError, match="fla backend needs a CUDA device"):
            resolve_backend("fla", DEVICE)
    torch_path = backend_of("torch")
    with pytest.raises(ValueError, match="beta"):
        kda(*args[:4], x["beta"][..., None], backend=torch_path)
    with pytest.raises(ValueError, match="initial_state"):
        kda(*args, initial_state=torch.zeros(1, 2, 16, 8), backend=torch_path)
    assert kda(*args, backend=backend_of("auto"))[0].shape == (1, 4, 2, 16)


def test_reference_matches_the_definition(generator):
    """The reference itself, one token by hand: S_1 = (I - b k k^T) Diag(e^g) S_0 + b k v^T."""
    x = make_inputs(1, 1, 1, 4, 3, generator)
    q, k, v, g, b = (x[n][0, 0, 0].detach().double() for n in ("q", "k", "v", "g", "beta"))
    S0 = x["initial_state"][0, 0].detach().double()
    S1 = (torch.eye(4, dtype=torch.float64) - b * torch.outer(k, k)) @ torch.diag(g.exp()) @ S0 + b * torch.outer(k, v)
    o, S = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, x["initial_state"])
    assert torch.allclose(S[0, 0].double(), S1, atol=1e-5)
    assert torch.allclose(o[0, 0, 0].double(), S1.T @ (0.5 * q), atol=1e-5)
