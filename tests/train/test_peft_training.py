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
def test_a_lora_run_moves_only_its_adapters_and_resumes_exactly(small_dataset, tmp_path, monkeypatch):
    from genome_lm.train import trainer
    from genome_lm.train.trainer import train

    built = []
    monkeypatch.setattr(trainer, "build", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    whole = train(_config(small_dataset, tmp_path / "a"), progress=False)
    assert whole.steps_done == 4 and whole.stopped_by is None
    ckpts = tmp_path / "a" / "checkpoints"
    second, fourth = read_weights(ckpts / "step-000002"), read_weights(ckpts / "step-000004")
    trained = {n: t.detach().clone() for n, t in built[0].named_parameters()}
    trained |= {n: b.detach().clone() for n, b in built[0].named_buffers() if n.endswith("expert_bias")}
    with parallel_context() as pg:  # the base as the run started from it
        base = build(load_config("demo-finetune-cpu", ["model.kernel_backend=torch"]), pg, ParallelSizes())
        start = {n: t.detach().clone() for n, t in base.named_parameters()}
        start |= {n: b.detach().clone() for n, b in base.named_buffers() if n.endswith("expert_bias")}
    adapters = {n for n in trained if ".lora_" in n}
    assert adapters and set(trained) == set(start) | adapters
    for name, tensor in start.items():
        assert torch.equal(trained[name], tensor), name  # frozen: bit for bit, expert biases too
    # the checkpoint holds the adapters only (their latest values), and names its base
    assert set(fourth) == adapters and all(torch.equal(fourth[n], trained[n]) for n in adapters)
    assert any(not torch.equal(second[n], fourth[n]) for n in adapters)
    meta = json.loads((ckpts / "step-000004" / "meta.json").read_text())
    assert meta["base"]["checkpoint"].endswith("tiny-long") and len(meta["base"]["digest"]) == 64
    assert not any(".lora_" not in k for k in meta["tensors"] if k.startswith("model/"))
    assert {k.split("/")[2] for k in meta["tensors"] if k.startswith("optim/")} <= adapters

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

    # the adapters alone in the Hugging Face PEFT layout: peft loads them onto transformers' glm5_next
    import subprocess
    import sys

    from genome_lm import weights
    from tests.checkpoint.test_hf_peft import ORACLE

    folder = export_run(tmp_path / "a", tmp_path / "adapters", adapters=True)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    torch.save(tokens, tmp_path / "tokens.pt")
    result = subprocess.run([sys.executable, "-c", ORACLE, str(weights.resolve("builtin:tiny-long")),
                             str(tmp_path / "tokens.pt"), str(tmp_path / "peft.pt"), f"{folder}=run"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = torch.load(tmp_path / "peft.pt")
    scale = run_logits.abs().max()
    assert (theirs["run"] - run_logits).abs().max() / scale < 1e-4
    assert (theirs["base"] - run_logits).abs().max() / scale > 1e-3  # without the adapters: visibly other

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



@pytest.mark.slow
def test_a_tp2_adapter_checkpoint_resumes_in_one_process_and_refuses_another_base(small_dataset, tmp_path):
    """Two LoRA steps on two Ray workers with tensor parallel 2, resumed in one process from the
    adapter checkpoint: the unbroken one-process run's losses; the same checkpoint onto a base
    whose weights changed is refused in one line (resume and export, exit 1, nothing written)."""
    from typer.testing import CliRunner

    from genome_lm.cli import app
    from genome_lm.train.launch import train_on_ray
    from genome_lm.train.trainer import train
    from tests.train.parallel_runs import assert_same_history, overrides, tiny_checkpoint

    base = tiny_checkpoint(tmp_path / "base")
    common = overrides(small_dataset, base, seq_len=300, batch=2,
                       extra=["train.steps=4", "train.save_every=2", "peft.method=lora", "peft.rank=4",
                              "peft.train=['*.router.weight']"])
    unbroken = train(load_config("demo-cpu", common + [f"train.out_dir={tmp_path / 'one'}"]), progress=False)
    out = f"train.out_dir={tmp_path / 'tp2'}"
    first = train_on_ray(load_config("demo-cpu", common + ["parallel.tp=2", out]), address="local", workers=2,
                         progress=False, max_steps=2)
    second = train(load_config("demo-cpu", common + [out]), progress=False, resume=True)
    assert [m.step for m in second.history] == [3, 4]

    class Joined:
        history = list(first.history) + list(second.history)

    assert_same_history(unbroken, Joined, tokens=600)

    # the base's weights change under the same path: the adapters are refused
    tiny_checkpoint_seeded(base, seed=1)
    shutil.rmtree(tmp_path / "tp2" / "checkpoints" / "step-000004")
    (tmp_path / "tp2" / "checkpoints" / "latest").write_text("step-000002\n")
    sets = [x for s in common + [out] for x in ("--set", s)]
    for args, made in ((["finetune", "--config", "demo-cpu", "--resume", "--quiet", *sets],
                        tmp_path / "tp2" / "checkpoints" / "step-000004"),
                       (["export", "--run", str(tmp_path / "one"), "--out", str(tmp_path / "hf")], tmp_path / "hf")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, result.output
        assert "trained on the base" in result.output and len(result.output.strip().splitlines()) == 1, result.output
        assert not made.exists()


def tiny_checkpoint_seeded(out, seed):
    """Overwrite ``out`` with other random weights of the tiny model (same architecture)."""
    from genome_lm.checkpoint.huggingface import export_hf_checkpoint
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model

    shutil.rmtree(out)
    with parallel_context() as pg:
        torch.manual_seed(seed)
        export_hf_checkpoint(build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch"), out)
