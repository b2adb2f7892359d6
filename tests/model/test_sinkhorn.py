"""mHC's Sinkhorn normalisation (``genome_lm_kernels.mhc``) with its recomputing backward, torch
and C, and the reference path, against autograd through the plain loop (written out here as
transformers' glm5_next writes it), in float64 and float32."""

import importlib

import pytest
import torch

from genome_lm.model import common
from genome_lm_kernels import mhc, resolve_backend
from genome_lm_kernels.cpu import native

recompute = importlib.import_module("genome_lm_kernels.mhc.recompute")
mhc_reference = importlib.import_module("genome_lm_kernels.mhc.reference")
mhc_native = importlib.import_module("genome_lm_kernels.mhc.native")


def _loop(z, iters, eps):
    """The plain loop, autograd through every step: the package's reference (transformers'
    glm5_next's order of operations), checked below to give doubly stochastic matrices."""
    return mhc_reference.sinkhorn(z, iters, eps)


def test_the_reference_is_doubly_stochastic():
    """Its last step normalises the columns (they sum to 1 but for eps); the rows converge over the
    iterations (a few percent off after 20 at these logits, far more after 1)."""
    z = torch.randn(50, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ones = torch.ones(50, 4, dtype=torch.float64)
    c = _loop(z, 20, 1e-6)
    assert (c > 0).all()
    torch.testing.assert_close(c.sum(-2), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(c.sum(-1), ones, atol=0.02, rtol=0)
    assert (_loop(z, 1, 1e-6).sum(-1) - 1).abs().max() > 5 * (c.sum(-1) - 1).abs().max()


@pytest.mark.parametrize("dtype,tol,path", [(torch.float64, 1e-12, "torch"), (torch.float32, 1e-5, "torch"),
                                            (torch.float32, 1e-5, "C"), (torch.float32, 1e-5, "reference")])
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("n", [2, 4])
def test_matches_autograd_through_the_loop(monkeypatch, dtype, tol, path, iters, n):
    """The torch path (float64 and float32) and the C kernel (``genome_lm_kernels/cpu/mhc.c``,
    float32; n = 4 has its own compiled loops): 5 x 29 tokens, over two threads, in uneven
    blocks (7 tokens in torch's backward, 64 in C's)."""
    monkeypatch.setattr(native, "MIN_ROWS_PER_THREAD", 1)
    monkeypatch.setattr(recompute, "BLOCK", 7)  # several uneven backward blocks
    g = torch.Generator().manual_seed(iters * 10 + n)
    z = (3 * torch.randn(5, 29, n, n, generator=g, dtype=dtype)).requires_grad_()
    upstream = torch.randn(5, 29, n, n, generator=g, dtype=dtype)
    ran = []
    monkeypatch.setattr(mhc_native, "sinkhorn_c", lambda *a, f=mhc_native.sinkhorn_c: ran.append(a[0]) or f(*a))
    steps = []
    monkeypatch.setattr(recompute, "steps", lambda *a, f=recompute.steps: steps.append(1) or f(*a))
    backend = resolve_backend("reference" if path == "reference" else "torch", "cpu", native=path == "C")
    got = mhc.sinkhorn(z, iters, 1e-6, backend=backend)
    (dz_got,) = torch.autograd.grad(got, z, upstream)
    want = _loop(z, iters, 1e-6)
    (dz_want,) = torch.autograd.grad(want, z, upstream)
    assert (got - want).abs().max() <= tol
    assert (dz_got - dz_want).abs().max() <= tol * dz_want.abs().max()
    assert ran == (["mhc_sinkhorn_fwd", "mhc_sinkhorn_bwd"] if path == "C" else [])
    assert bool(steps) == (path == "torch")  # the reference runs neither recomputing path


def test_gradcheck():
    z = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    backend = resolve_backend("torch", "cpu")
    assert torch.autograd.gradcheck(lambda x: mhc.sinkhorn(x, 4, 1e-6, backend=backend), (z,))


@pytest.mark.slow  # compiles (about 30 s the first time on 2 cores; inductor caches it on disk)
def test_compiled_matches_the_loop_across_lengths(monkeypatch):
    """``compiled=True`` (torch.compile with dynamic shapes, ``model.compile``): the same values
    and gradients as the plain loop, at several token counts from one compilation, the last
    split into uneven backward blocks; the token counts do not force new compilations."""
    import torch._dynamo

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # tests/conftest.py turns dynamo off; read by torch.compile
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(recompute, "_COMPILED", None)
    g = torch.Generator().manual_seed(0)
    for tokens in (64, 200, 333):
        if tokens == 333:
            monkeypatch.setattr(recompute, "BLOCK", 100)
        z = (3 * torch.randn(tokens, 4, 4, generator=g)).requires_grad_()
        upstream = torch.randn(tokens, 4, 4, generator=g)
        got = mhc.sinkhorn(z, 20, 1e-6, backend=resolve_backend("torch", "cpu", native=False), compiled=True)
        (dz_got,) = torch.autograd.grad(got, z, upstream)
        want = _loop(z, 20, 1e-6)
        (dz_want,) = torch.autograd.grad(want, z, upstream)
        assert (got - want).abs().max() <= 1e-5
        assert (dz_got - dz_want).abs().max() <= 1e-5 * dz_want.abs().max()
    assert recompute._COMPILED is not None
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # the steps and the gradient, once more for the gradient on strided backward blocks; not
    # one per token count (64, 200, then blocks of 100 and 33)
    assert 2 <= graphs <= 3, f"{graphs} graphs compiled: token counts forced recompiles"


@pytest.fixture
def pg():
    from genome_lm.engine.parallel import parallel_context

    with parallel_context() as groups:
        yield groups


def test_model_compile_reaches_every_hyper_connection(pg):
    """``model.compile: true`` in a run config builds every mHC with the compiled Sinkhorn (and
    only then: the default stays eager)."""
    from genome_lm.checkpoint.models import build
    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes

    for flag in (False, True):
        run = RunConfig.model_validate({"model": {"preset": "tiny", "compile": flag}})
        model = build(run, pg, ParallelSizes())
        hcs = [m for m in model.modules() if isinstance(m, common.HyperConnection)]
        assert len(hcs) == 2 * len(model.layers) and all(h.compiled is flag for h in hcs)


def test_model_compile_without_a_cpp_compiler_warns_and_runs_eager(pg, monkeypatch, caplog):
    """A speed option must not stop a run: without a C++ compiler the model is built uncompiled
    and the log says why."""
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model

    def no_compiler():
        raise InvalidCxxCompiler

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with caplog.at_level("WARNING"):
        model = build_model(get_preset("tiny"), pg, ParallelSizes(), compiled=True)
    assert "no C++ compiler found" in caplog.text
    assert not any(m.compiled for m in model.modules() if isinstance(m, common.HyperConnection))
