"""Context-parallel training: two CPU workers (gloo, on a local Ray cluster) that split every
sequence in the zigzag layout give the losses and gradient norms of one process that takes the
whole sequences."""

import pytest

from genome_lm.config import load_config
from genome_lm.train.launch import train_on_ray
from genome_lm.train.trainer import train


@pytest.mark.slow
def test_cp2_matches_one_process_on_uneven_lengths(small_dataset, tmp_path):
    # 1022 is not a multiple of 2 * cp = 4: each sequence is padded by 2 before the split
    common = [f"data.dataset={small_dataset}", "train.steps=3", "data.seq_len=1022", "train.global_batch_size=2",
              "model.kernel_backend=torch", "train.indexer_dense_steps=1", "train.lr=1e-2"]
    one = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    two = train_on_ray(load_config("demo-cpu", common + ["parallel.cp=2", f"train.out_dir={tmp_path / 'cp2'}"]),
                       address="local", workers=2, progress=False)
    assert two.steps_done == 3
    for a, b in zip(one.history, two.history, strict=True):
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5)
        # the indexer KL (about 1e-5 here) is a difference of O(1) terms: compare it in absolute terms
        assert b.indexer_loss == pytest.approx(a.indexer_loss, rel=1e-4, abs=1e-8)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert a.tokens <= b.tokens <= a.tokens + 2 * 3  # the padding, at most 2 * cp - 1 per sequence
