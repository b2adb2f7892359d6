"""Expert parallel training: two CPU workers (gloo, on a local Ray cluster) that each hold half
of every MoE layer's routed experts and one sequence of the global batch give the losses and
gradient norms of one process that holds all experts and both sequences. Tokens reach the
experts of the other rank through megatron-core's token dispatcher; expert gradients are
reduced over the expert-data-parallel group (of one rank here), the rest over data parallel."""

import pytest

from genome_lm.config import load_config
from genome_lm.engine.launch import train_on_ray
from genome_lm.train.trainer import train
from tests.train.test_sequence_parallel import _tiny_checkpoint


@pytest.mark.slow
def test_ep2_matches_one_process(small_dataset, tmp_path):
    ckpt = _tiny_checkpoint(tmp_path / "hf")
    common = [f"data.dataset={small_dataset}", "train.steps=3", "data.seq_len=300", "train.global_batch_size=2",
              "model.kernel_backend=torch", "train.indexer_dense_steps=1", "train.lr=1e-2",
              "train.moe_aux_loss_coeff=1e-2", f"model.checkpoint={ckpt}"]
    one = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    two = train_on_ray(load_config("demo-cpu", common + ["parallel.ep=2", f"train.out_dir={tmp_path / 'ep2'}"]),
                       address="local", workers=2, progress=False)
    assert two.steps_done == 3
    for a, b in zip(one.history, two.history, strict=True):
        assert b.tokens == a.tokens == 600
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5)
        assert b.indexer_loss == pytest.approx(a.indexer_loss, rel=1e-4, abs=1e-8)
        assert b.moe_aux_loss == pytest.approx(a.moe_aux_loss, rel=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert b.moe_max_over_mean == pytest.approx(a.moe_max_over_mean, rel=1e-6)
    assert (tmp_path / "ep2" / "checkpoints" / "latest").exists()
