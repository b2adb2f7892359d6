"""Training on a real local Ray cluster: two CPU workers joined with gloo (data parallel 2)."""

import pytest

from genome_lm.config import load_config
from genome_lm.train.launch import train_on_ray
from genome_lm.train.trainer import train


@pytest.mark.slow
def test_two_ray_workers_match_one_process(small_dataset, tmp_path):
    """The global batch of 2 sequences split over 2 ranks gives the losses of one process that
    takes both sequences: the loss is normalised over the global batch and gradients are summed."""
    common = [f"data.dataset={small_dataset}", "train.steps=3", "data.seq_len=256", "train.global_batch_size=2",
              "model.kernel_backend=torch", "train.indexer_dense_steps=1", "train.lr=1e-2"]
    one = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    two = train_on_ray(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'two'}"]), address="local",
                       workers=2, progress=False)
    assert two.steps_done == 3
    for a, b in zip(one.history, two.history):
        assert a.tokens == b.tokens == 512
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    assert (tmp_path / "two" / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("changes, workers, message", [
    (["parallel.pp=3"], 3, "pipeline parallel 3 cannot split the 4 layers"),
    (["parallel.pp=2"], 3, "world size 3 is not a multiple of tp\\*cp\\*pp = 2"),
])
def test_a_bad_layout_is_refused_before_ray_starts(tmp_path, monkeypatch, changes, workers, message):
    import ray

    from genome_lm.errors import GenomeLMError

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a layout the ranks cannot hold")

    monkeypatch.setattr(ray, "init", no_ray)
    cfg = load_config("demo-cpu", changes + [f"train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(GenomeLMError, match=message):
        train_on_ray(cfg, address="local", workers=workers, progress=False)
    assert not ray.is_initialized() and not (tmp_path / "run").exists()
