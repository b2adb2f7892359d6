"""``finetune`` with ``peft.method=lora`` through the real trainer: the base (and the routers'
expert biases) never move, the adapters do, and a run resumed from its checkpoint continues the
unbroken run's losses exactly."""

import json
import shutil

import pytest
import torch

from genome_lm.checkpoint import build
from genome_lm.checkpoint.training import read_weights
from genome_lm.config import load_config
from genome_lm.engine.parallel import ParallelSizes, parallel_context


def _config(small_dataset, out, *more):
    return load_config("demo-finetune-cpu", [
        f"data.dataset={small_dataset}", "data.seq_len=256", "train.global_batch_size=2", "train.steps=4",
        "train.save_every=2", "train.warmup_steps=1", "train.lr=1e-2", "model.kernel_backend=torch",
        "peft.method=lora", "peft.rank=4", f"train.out_dir={out}", *more])


@pytest.mark.slow
def test_a_lora_run_moves_only_its_adapters_and_resumes_exactly(small_dataset, tmp_path):
    from genome_lm.train.trainer import train

    whole = train(_config(small_dataset, tmp_path / "a"), progress=False)
    assert whole.steps_done == 4 and whole.stopped_by is None
    ckpts = tmp_path / "a" / "checkpoints"
    second, fourth = read_weights(ckpts / "step-000002"), read_weights(ckpts / "step-000004")
    with parallel_context() as pg:  # the base as the run started from it
        base = build(load_config("demo-finetune-cpu", ["model.kernel_backend=torch"]), pg, ParallelSizes())
        start = {n: t.detach().clone() for n, t in base.named_parameters()}
        start |= {n: b.detach().clone() for n, b in base.named_buffers() if n.endswith("expert_bias")}
    adapters = {n for n in fourth if ".lora_" in n}
    assert adapters and set(fourth) == set(start) | adapters
    for name, tensor in start.items():
        assert torch.equal(fourth[name], tensor), name  # frozen: bit for bit, expert biases too
    assert any(not torch.equal(second[n], fourth[n]) for n in adapters)

    # the same run stopped after step 2, resumed from its checkpoint
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed_ckpts = tmp_path / "b" / "checkpoints"
    shutil.rmtree(resumed_ckpts / "step-000004")
    (resumed_ckpts / "latest").write_text("step-000002\n")
    resumed = train(_config(small_dataset, tmp_path / "b"), progress=False, resume=True)
    assert [m.lm_loss for m in resumed.history] == [m.lm_loss for m in whole.history[2:]]
    again = read_weights(resumed_ckpts / "step-000004")
    assert all(torch.equal(again[n], fourth[n]) for n in fourth)

    # exported merged: the Hugging Face folder gives the run's logits (base + adapters)
    from genome_lm.eval.models import load_model
    from genome_lm.train.export import export_run

    hf = export_run(tmp_path / "a", tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    assert index and not any("lora" in k for k in index)
    tokens = torch.randint(4, 8, (2, 200), generator=torch.Generator().manual_seed(5))
    with parallel_context() as pg, torch.no_grad():
        run_logits = load_model(tmp_path / "a", pg).model.eval()(tokens).logits
        hf_logits = load_model(hf, pg).model.eval()(tokens).logits
        base_logits = load_model("builtin:tiny-long", pg).model.eval()(tokens).logits
    gap = (run_logits - hf_logits).abs().max()
    assert gap / run_logits.abs().max() < 1e-6, gap
    assert gap < (run_logits - base_logits).abs().max() / 100  # the adapters moved the logits; the export has them

    # a LoRA run's checkpoint is not yet a start for another run: one line, exit 1, nothing written
    from typer.testing import CliRunner

    from genome_lm.cli import app

    sets = [f"data.dataset={small_dataset}", "data.seq_len=256", "model.kernel_backend=torch",
            f"model.checkpoint={tmp_path / 'a'}", f"train.out_dir={tmp_path / 'c'}"]
    result = CliRunner().invoke(app, ["finetune", "--config", "demo-finetune-cpu", "--quiet",
                                      *(x for s in sets for x in ("--set", s))])
    assert result.exit_code == 1, result.output
    assert "a LoRA run's checkpoint" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "c" / "checkpoints").exists()

