"""A run resumed under another parallel layout continues the loss curve of the run that went
through: two steps on two Ray workers with tensor parallel 2, then resumed in one process from
that checkpoint (weights, AdamW's moments and the data loader's position all resharded), against
four steps in one process; and the other way, from one process onto expert parallel 2."""

import pytest

from genome_lm.config import load_config
from genome_lm.train.launch import train_on_ray
from genome_lm.train.trainer import train
from tests.train.parallel_runs import assert_same_history, overrides, tiny_checkpoint


class _Joined:
    """The history of a run cut in two, as ``assert_same_history`` reads it."""

    def __init__(self, first, second):
        self.history = list(first.history) + list(second.history)


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume-layout")
    common = overrides(small_dataset, tiny_checkpoint(root / "hf"), seq_len=300, batch=2,
                       extra=["train.steps=4", "train.save_every=2"])
    unbroken = train(load_config("demo-cpu", common + [f"train.out_dir={root / 'one'}"]), progress=False)
    return root, common, unbroken


@pytest.mark.slow
def test_tp2_run_resumes_in_one_process(runs):
    root, common, unbroken = runs
    out = f"train.out_dir={root / 'tp2'}"
    first = train_on_ray(load_config("demo-cpu", common + ["parallel.tp=2", out]), address="local", workers=2,
                         progress=False, max_steps=2)
    assert first.steps_done == 2
    second = train(load_config("demo-cpu", common + [out]), progress=False, resume=True)
    assert [m.step for m in second.history] == [3, 4]
    assert_same_history(unbroken, _Joined(first, second), tokens=600)


@pytest.mark.slow
def test_one_process_run_resumes_on_expert_parallel_2(runs):
    root, common, unbroken = runs
    out = f"train.out_dir={root / 'ep2'}"
    first = train(load_config("demo-cpu", common + [out]), progress=False, max_steps=2)
    second = train_on_ray(load_config("demo-cpu", common + ["parallel.ep=2", out]), address="local", workers=2,
                          progress=False, resume=True)
    assert [m.step for m in second.history] == [3, 4]
    assert_same_history(unbroken, _Joined(first, second), tokens=600)
