"""`parallel.gpus`: a config states the GPU count its runs use; the planner plans that many when
--gpus is not given, and the trainer refuses another number of ranks (issue 53, item 6)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.config import CONFIG_DIR, load_config
from genome_lm.errors import GenomeLMError
from genome_lm.plan.memory_model import Hardware, estimate
from genome_lm.plan.time_model import estimate_time

runner = CliRunner()
COUNTED = re.compile(r"-(\d+)(?:xb200|gpu)(?:-searched|-lora)?$")  # -64xb200, -64xb200-searched, -8xb200-lora, -1gpu


def invoke(*args):
    return runner.invoke(app, ["plan", *args], env={"COLUMNS": "200"})


def test_configs_named_for_a_gpu_count_state_it():
    names = [p.stem for p in CONFIG_DIR.glob("*.yaml")]
    counted = {name: int(m.group(1)) for name in names if (m := COUNTED.search(name))}
    assert len(counted) == 6
    for name, gpus in counted.items():
        assert load_config(name).parallel.gpus == gpus, name
    assert all(load_config(name).parallel.gpus is None for name in names if name not in counted)


def test_the_planner_plans_the_stated_count():
    """tp 2 x cp 32 with 4 sequences a step: one micro-batch per rank would be 256 GPUs; the
    config says 64 (dp 1, each rank runs the 4 sequences in turn)."""
    run = load_config("glm-5.3-flash-1m-64xb200-searched")
    assert estimate(run, Hardware()).gpus == 64 and estimate_time(run).gpus == 64
    assert estimate(load_config("glm-5.3-flash-1m-64xb200-searched", ["parallel.gpus=null"]), Hardware()).gpus == 256
    result = invoke("--config", "glm-5.3-flash-1m-64xb200-searched")
    assert result.exit_code == 0, result.output
    assert "1M tokens on 64 x B200" in result.output and "Step time of" in result.output
    assert "on 64 x B200" in result.output.split("Step time of")[1].splitlines()[0]
    # --gpus still wins over the config's count
    result = invoke("--config", "glm-5.3-flash-1m-64xb200-searched", "--gpus", "128", "--json")
    assert result.exit_code == 0, result.output
    assert '"gpus": 128' in result.output


@pytest.mark.parametrize("overrides,message", [
    (["parallel.gpus=6", "parallel.tp=4"], "parallel.gpus = 6 is not a multiple of tp x cp x pp = 4"),
    (["parallel.gpus=4", "parallel.ep=8"], "parallel.gpus = 4 is not a multiple of ep x etp x pp = 8"),
    (["parallel.gpus=2", "parallel.ep=2", "parallel.pp=2"], "is not a multiple of ep x etp x pp = 4"),
    (["parallel.gpus=0"], "parallel.gpus: Input should be greater than 0"),
])
def test_a_stated_count_must_hold_the_layout(overrides, message):
    with pytest.raises(GenomeLMError, match=re.escape(message)) as info:
        load_config("demo-cpu", overrides)
    assert "\n" not in str(info.value)


def test_a_changed_layout_must_fit_the_stated_count():
    result = invoke("--config", "glm-5.3-flash-1m-64xb200", "--pp", "3")
    assert result.exit_code == 1
    assert "parallel.gpus = 64 is not a multiple of tp x cp x pp = 48" in result.output
    assert len(result.output.strip().splitlines()) == 1
    # with --gpus the command states the count itself
    result = invoke("--config", "glm-5.3-flash-1m-64xb200", "--pp", "3", "--gpus", "192")
    assert result.exit_code == 0, result.output
    assert "on 192 x B200" in result.output


def test_a_suggestion_keeps_the_data_parallel_size_of_the_stated_count():
    """More context parallel and pipeline stages multiply the config's 64 GPUs, as they do a derived
    count (a regression guard: it passed before too)."""
    result = invoke("--config", "glm-5.3-flash-512k-64xb200", "--gpu-mem", "60")
    assert result.exit_code == 0, result.output
    assert "on 64 x 60 GB" in result.output and "cheapest change that fits" in result.output
    assert "context parallel 4 + pipeline parallel 3" in result.output and "on 768 GPUs" in result.output


def test_the_trainer_refuses_another_number_of_ranks(tmp_path):
    """One line naming both numbers, before a Ray cluster is asked for workers and on every
    rank of a torchrun job."""
    from genome_lm.train.launch import check_layout
    from genome_lm.train.trainer import train

    cfg = load_config("glm-5.3-flash-1m-64xb200")
    check_layout(cfg, 64)
    with pytest.raises(GenomeLMError, match="parallel.gpus is 64 but the job has 128 ranks") as info:
        check_layout(cfg, 128)
    assert "\n" not in str(info.value)
    one = load_config("demo-cpu", ["parallel.gpus=2", f"train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(GenomeLMError, match="parallel.gpus is 2 but the job has 1 rank"):
        train(one, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()
