"""One place turns a backend name into a backend: ``resolve_backend``. Every public op takes the
resolved object and refuses a name; what each op runs under each backend is the object's."""

from __future__ import annotations

import pytest
import torch

from genome_lm_kernels import BACKENDS, KernelBackend, gpu_default, resolve_backend

from .conftest import backend_of


def test_auto_is_the_device_default():
    assert resolve_backend("auto", "cpu").name == "torch"
    assert resolve_backend("auto", "cuda").name == gpu_default()  # values only: no GPU needed
    resolved = resolve_backend("triton", "cuda")
    assert resolve_backend(resolved, "cuda") == resolved  # a resolved backend passes through, checked


@pytest.mark.parametrize("name,kda,dsa,exact,gpu", [
    ("reference", "reference", "reference", False, False),
    ("torch", "torch", "torch", False, False),
    ("triton", "triton", "triton", False, True),
    ("triton-fp32", "triton", "triton", True, True),
    ("fla", "fla", "triton", False, True),
])
def test_what_each_op_runs(name, kda, dsa, exact, gpu):
    b = resolve_backend(name, "cuda")
    assert (b.kda, b.dsa, b.exact, b.gpu, str(b)) == (kda, dsa, exact, gpu, name)


def test_every_name_is_covered():
    assert {resolve_backend(n, "cuda").name for n in BACKENDS} == set(BACKENDS)


def test_a_name_compared_with_a_backend_is_an_error():
    """``backend == "triton"`` on a resolved backend would be silently False; it raises instead."""
    b = resolve_backend("torch", "cpu")
    with pytest.raises(TypeError, match=r"\.name"):
        _ = b == "torch"
    assert b == KernelBackend(name="torch", device="cpu", native=b.native) and b != resolve_backend("reference", "cpu")
    assert b != resolve_backend("torch", "cpu", native=not b.native)  # the C choice is part of the backend
    assert len({b, resolve_backend("torch", "cpu")}) == 1


def test_every_op_refuses_a_name(generator):
    from genome_lm_kernels import dsa
    from genome_lm_kernels.kda import kda

    B, T, H, D = 1, 8, 2, 8
    r = lambda *s: torch.randn(*s, generator=generator)  # noqa: E731
    q, k, w = r(B, T, H, D), r(B, T, D), r(B, T, H)
    idx, _ = dsa.select_tokens(q, k, w, kpool=4, topk=8, backend=backend_of("torch"))
    calls = {
        "kda": lambda b: kda(r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), -torch.rand(B, T, H, D),
                             torch.rand(B, T, H), backend=b),
        "select_tokens": lambda b: dsa.select_tokens(q, k, w, kpool=4, topk=8, backend=b),
        "sparse_attention": lambda b: dsa.sparse_attention(r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), idx,
                                                           scale=0.3, backend=b),
        "sparse_mla": lambda b: dsa.sparse_mla(r(B, T, H, D), r(B, T, D), idx, scale=0.3, dv=4, backend=b),
        "indexer_loss": lambda b: dsa.indexer_loss(q, k, w, r(B, T, H, D), r(B, T, H, D), kpool=4, scale=0.3,
                                                   backend=b),
    }
    for op, call in calls.items():
        with pytest.raises(TypeError, match=rf"{op}\(\) takes a resolved backend"):
            call("torch")
        out = call(backend_of("torch"))  # the resolved one runs
        assert torch.isfinite(out[0] if isinstance(out, tuple) else out).all()
