"""Pipeline parallel training: two CPU workers (gloo, on a local Ray cluster), each one stage of
the model, trained with genome-lm's 1F1B schedule, give the losses and gradient norms of one
process, and a run stopped after two steps resumes to the same third step."""

import pytest
import torch

from genome_lm.config import load_config
from genome_lm.engine.launch import train_on_ray
from genome_lm.train.trainer import train


def _checkpoint(out):
    """The tiny model with a DSA layer on each stage of a 2-stage split (layers 1 and 3), so
    both stages' indexer losses and MoE layers train; random weights as a Hugging Face
    checkpoint, the start of both runs."""
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model import get_preset
    from genome_lm.model.config import INDEXED, LINEAR
    from genome_lm.model.hf_checkpoint import export_hf_checkpoint
    from genome_lm.model.model import build_model

    cfg = get_preset("tiny").replace(layer_types=(LINEAR, INDEXED, LINEAR, INDEXED))
    with parallel_context() as pg:
        torch.manual_seed(0)
        export_hf_checkpoint(build_model(cfg, pg, ParallelSizes(), kernel_backend="torch"), out)
    return out


@pytest.mark.slow
def test_pp2_matches_one_process_and_resumes(small_dataset, tmp_path):
    ckpt = _checkpoint(tmp_path / "hf")
    # 4 micro-batches per step: warm-up, steady 1F1B and cool-down on the first stage. lr 1e-3: at
    # 1e-2 the runs part by ~1e-5 at step 3 (a router's top-k near a tie can flip on rounding)
    common = [f"data.dataset={small_dataset}", "train.steps=3", "data.seq_len=300", "train.global_batch_size=4",
              "model.kernel_backend=torch", "train.indexer_dense_steps=1", "train.lr=1e-3",
              "train.moe_aux_loss_coeff=1e-2", f"model.checkpoint={ckpt}"]
    one = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    pp2 = load_config("demo-cpu", common + ["parallel.pp=2", f"train.out_dir={tmp_path / 'pp2'}"])
    two = train_on_ray(pp2, address="local", workers=2, progress=False)
    assert two.steps_done == 3
    for a, b in zip(one.history, two.history, strict=True):
        assert b.tokens == a.tokens == 1200
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5)
        # the indexer loss is a KL divergence that falls to ~1e-5 by step 3: its float rounding is
        # absolute (~1e-9), as in the sequence-parallel test
        assert a.indexer_loss > 0 and b.indexer_loss == pytest.approx(a.indexer_loss, rel=1e-4, abs=1e-8)
        assert b.moe_aux_loss == pytest.approx(a.moe_aux_loss, rel=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert b.moe_max_over_mean == pytest.approx(a.moe_max_over_mean, rel=1e-6)

    # stopped after 2 steps (checkpointed), resumed: the third step as in the run that went through
    stopped = pp2.model_copy(update={"train": pp2.train.model_copy(update={"out_dir": str(tmp_path / "stopped")})})
    assert train_on_ray(stopped, address="local", workers=2, progress=False, max_steps=2).steps_done == 2
    resumed = train_on_ray(stopped, address="local", workers=2, progress=False, resume=True)
    assert [m.step for m in resumed.history] == [3]
    assert resumed.history[0].lm_loss == two.history[2].lm_loss
    assert resumed.history[0].grad_norm == two.history[2].grad_norm
