"""The evaluation paths feed their token ids to the device the model's parameters are on
(``build_model`` puts the model on the GPU when there is one). No GPU here: a module whose
parameter lives on the ``meta`` device records where its input arrived and stops the call."""

import numpy as np
import pytest
import torch

from genome_lm.eval.probes.recall import SequencePool, run_recall_bench
from genome_lm.eval.score import token_nll


class Arrived(Exception):
    pass


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))
        self.seen = None

    def forward(self, ids):
        self.seen = ids.device
        raise Arrived


def test_token_nll_sends_ids_to_the_models_device():
    # (the chunked prefill takes the same ids; it needs a real model, so it is not run here)
    model = Recorder()
    with pytest.raises(Arrived):
        token_nll(model, np.array([1, 4, 5, 6, 7, 4, 5, 6, 7, 2]), token_map=torch.arange(9))
    assert model.seen == torch.device("meta")


def test_recall_bench_adapter_sends_ids_to_the_models_device():
    pytest.importorskip("recall_bench")
    model = Recorder()
    with pytest.raises(Arrived):
        run_recall_bench(model, SequencePool.random(4096, seed=0), [64], trials=1, segment=16)
    assert model.seen == torch.device("meta")
