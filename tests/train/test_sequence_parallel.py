"""Tensor + sequence parallel training: two CPU workers (gloo, on a local Ray cluster) that split
the heads, the vocabulary and, in the residual streams, the positions give the losses and
gradient norms of one process."""

import pytest
import torch

from genome_lm.config import load_config
from genome_lm.engine.launch import train_on_ray
from genome_lm.train.trainer import train


def _tiny_checkpoint(out):
    """The tiny model's random weights as a Hugging Face checkpoint: random initialisation
    under tensor parallel draws other weights, so both runs start from this."""
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model import get_preset
    from genome_lm.model.hf_checkpoint import export_hf_checkpoint
    from genome_lm.model.model import build_model

    with parallel_context() as pg:
        torch.manual_seed(0)
        export_hf_checkpoint(build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch"), out)
    return out


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_one_process(small_dataset, tmp_path):
    ckpt = _tiny_checkpoint(tmp_path / "hf")
    # 1021 positions: the streams are padded by one row to two slices of 511
    common = [f"data.dataset={small_dataset}", "train.steps=3", "data.seq_len=1021", "train.global_batch_size=2",
              "model.kernel_backend=torch", "train.indexer_dense_steps=1", "train.lr=1e-2",
              f"model.checkpoint={ckpt}"]
    one = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    two = train_on_ray(load_config("demo-cpu", common + ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                         f"train.out_dir={tmp_path / 'tp2-sp'}"]),
                       address="local", workers=2, progress=False)
    assert two.steps_done == 3
    for a, b in zip(one.history, two.history, strict=True):
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5)
        assert b.indexer_loss == pytest.approx(a.indexer_loss, rel=1e-4, abs=1e-8)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert b.tokens == a.tokens
