"""Expert parallel training: two CPU workers (gloo, on a local Ray cluster) that each hold half
of every MoE layer's routed experts and one sequence of the global batch give the losses and
gradient norms of one process that holds all experts and both sequences. Tokens reach the
experts of the other rank through megatron-core's token dispatcher; expert gradients are
reduced over the expert-data-parallel group (of one rank here), the rest over data parallel."""

import pytest

from genome_lm.config import load_config
from genome_lm.train.launch import train_on_ray
from genome_lm.train.trainer import train
from tests.train.parallel_runs import assert_same_history, overrides, tiny_checkpoint


@pytest.mark.slow
def test_ep2_matches_one_process(small_dataset, tmp_path):
    common = overrides(small_dataset, tiny_checkpoint(tmp_path / "hf"), seq_len=300, batch=2,
                       extra=["train.moe_aux_loss_coeff=1e-2"])
    one = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    two = train_on_ray(load_config("demo-cpu", common + ["parallel.ep=2", f"train.out_dir={tmp_path / 'ep2'}"]),
                       address="local", workers=2, progress=False)
    assert two.steps_done == 3
    assert_same_history(one, two, tokens=600, moe=True)
    assert (tmp_path / "ep2" / "checkpoints" / "latest").exists()
