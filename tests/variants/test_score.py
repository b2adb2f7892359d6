"""The shared-prefix scoring of alleles equals scoring each full window on its own (one forward
through the model per window), for SNVs, insertions and deletions, in one chunk or several."""

import numpy as np
import pytest
import torch

from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model import get_preset
from genome_lm.model.model import build_model
from genome_lm.variants.score import continuation_logprobs, full_window_logprobs


@pytest.fixture(scope="module")
def models():
    with parallel_context(ParallelSizes()) as pg:
        out = {}
        for backend in ("reference", "torch"):
            torch.manual_seed(0)
            out[backend] = build_model(get_preset("tiny-long"), pg, ParallelSizes(), kernel_backend=backend).eval()
        yield out


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("seed,chunk", [(1, None), (2, 128), (3, 77)])
def test_continuations_equal_full_windows(models, backend, seed, chunk):
    model = models[backend]
    rng = np.random.default_rng(seed)
    left, right = int(rng.integers(280, 420)), int(rng.integers(150, 330))  # uneven, past the top-k of 256
    prefix = rng.integers(4, 8, left)  # A, C, G, T token ids
    flank = rng.integers(4, 8, right)
    ref_base = int(rng.integers(4, 8))
    alleles = [np.array([ref_base]), np.array([4 + (ref_base - 3) % 4]),  # the reference, an SNV
               np.array([], dtype=np.int64), rng.integers(4, 8, 5)]  # a deletion of the base, an insertion
    continuations = [np.concatenate([a, flank]).astype(np.int64) for a in alleles]
    got = continuation_logprobs(model, prefix, continuations, chunk=chunk)
    for cont, lp in zip(continuations, got, strict=True):
        window = np.concatenate([prefix, cont])
        want = full_window_logprobs(model, window)[left - 1:]
        assert lp.shape == want.shape == (len(cont),)
        np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)


def test_a_variant_needs_preceding_context(models):
    with pytest.raises(ValueError, match="preceding context"):
        continuation_logprobs(models["torch"], np.array([], dtype=np.int64), [np.array([4, 5])])
