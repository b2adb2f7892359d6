"""Tensor + sequence parallel training: two CPU workers (gloo, on a local Ray cluster) that split
the heads, the vocabulary and, in the residual streams, the positions give the losses and
gradient norms of one process."""

import pytest

from genome_lm.config import load_config
from genome_lm.train.launch import train_on_ray
from genome_lm.train.trainer import train
from tests.train.parallel_runs import assert_same_history, overrides, tiny_checkpoint


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_one_process(small_dataset, tmp_path):
    # 1021 positions: the streams are padded by one row to two slices of 511
    common = overrides(small_dataset, tiny_checkpoint(tmp_path / "hf"), seq_len=1021, batch=2)
    one = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    two = train_on_ray(load_config("demo-cpu", common + ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                         f"train.out_dir={tmp_path / 'tp2-sp'}"]),
                       address="local", workers=2, progress=False)
    assert two.steps_done == 3
    assert_same_history(one, two)
