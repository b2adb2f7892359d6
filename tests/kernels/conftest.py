"""Helpers shared by the kernel tests: NaN-poisoned allocations and per-dtype error bounds."""

from __future__ import annotations

import pytest
import torch

# TRITON_INTERPRET=1 on machines without a GPU is set by tests/conftest.py, before triton loads.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Sequence lengths that are not multiples of a chunk (64) or a pool (4, 16).
LENGTHS = (1, 63, 65, 257, 1000)

# Relative error bound of a fast path against its fp32/fp64 reference, per input dtype:
# ||fast - ref|| / ||ref|| (Frobenius), the measure fla's tests use.
REL_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def backend_of(name: str):
    """The kernel backend ``name`` resolved for the tests' device (the ops take only resolved ones)."""
    from genome_lm_kernels import resolve_backend

    return resolve_backend(name, DEVICE)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), "non-finite values (an unwritten, NaN-poisoned element?)"
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.2e} > {REL_TOL[dtype]:.0e} ({dtype})"


@pytest.fixture
def nan_poison(monkeypatch):
    """Every floating tensor from torch.empty / empty_like / new_empty starts as NaN, so an
    output element a kernel forgets to write fails the comparison instead of passing as 0."""

    def poisoned(factory):
        def make(*args, **kwargs):
            out = factory(*args, **kwargs)
            if out.is_floating_point():
                out.fill_(float("nan"))
            return out

        return make

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
    yield


@pytest.fixture
def generator(request) -> torch.Generator:
    """A torch generator seeded from the test id, so a failure reproduces."""
    import zlib

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored afterwards: a token-loop reference is thousands of
    tiny ops, and OpenMP threads spinning on a busy 2-core machine slow its backward badly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
