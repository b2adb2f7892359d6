"""The scoring functions of a split model (``eval.parallel``), in one process: the head in blocks
of positions and the context ablation's rows give ``score.token_nll`` / ``token_nll_cut``."""

import numpy as np
import pytest
import torch

import genome_lm.eval.parallel as parallel
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.eval.score import token_nll, token_nll_cut
from genome_lm.model import get_preset
from genome_lm.model.model import build_model


@pytest.mark.parametrize("cut", [None, 100, 128], ids=["whole", "cut100", "cut128"])
def test_split_scoring_matches_the_one_process_scores(monkeypatch, cut):
    monkeypatch.setattr(parallel, "HEAD_CHUNK", 70)  # several blocks, the last one ragged
    tokens = np.random.default_rng(3).integers(0, 4, 333).astype(np.int64)
    with parallel_context(ParallelSizes()) as pg:
        torch.manual_seed(0)
        model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()
        want = token_nll(model, tokens) if cut is None else token_nll_cut(model, tokens, cut)
        got = parallel.split_window_nll(model, pg, tokens, None, cut)
    assert got.shape == want.shape == (332,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
