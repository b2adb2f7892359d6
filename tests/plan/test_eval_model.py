"""`genome-lm plan --eval`: the weights it counts are the model's own, the smallest layout it
names fits and none of half as many GPUs does, and the command prints both plans."""

import json

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.config import load_config
from genome_lm.plan.eval_model import candidate_layouts, estimate_eval, smallest_eval_layout
from genome_lm.plan.hardware import gpu_memory, gpu_spec
from genome_lm.plan.memory_model import Hardware, model_config, with_changes


def _hw(name: str) -> Hardware:
    name, size = gpu_memory(name, None)
    return Hardware(gpu_name=name, gpu_bytes=size)


def test_weights_are_the_built_models_parameters():
    """The tiny preset in one process, fp32: the plan's weight bytes against the parameters
    (and the routers' expert biases) of the model genome-lm builds."""
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.model import build_model

    run = load_config("demo-cpu", ["data.seq_len=4096"])
    plan = estimate_eval(run, Hardware(device="cpu", gpus=1))
    with parallel_context(ParallelSizes()) as pg:
        model = build_model(model_config(run), pg, ParallelSizes(), kernel_backend="torch")
        count = sum(p.numel() for p in model.parameters())
        count += sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
    weights = next(i for i in plan.memory if i.name.startswith("weights"))
    assert weights.bytes == count * 4


@pytest.mark.parametrize("gpu,seq_len", [("B200", 1 << 20), ("H200", 1 << 19)])
def test_the_smallest_layout_fits_and_half_the_gpus_do_not(gpu, seq_len):
    run = load_config("glm-5.3-flash-1m-64xb200", [f"data.seq_len={seq_len}"])
    hw = _hw(gpu)
    best = smallest_eval_layout(run, hw, gpu_spec(gpu))
    assert best is not None and best.fits and best.peak <= best.hw.usable
    assert best.tokens_per_s > 0 and best.window_seconds > 0
    from dataclasses import replace

    half = best.gpus // 2
    for layout in candidate_layouts(run, half):
        assert not estimate_eval(with_changes(run, parallel=layout), replace(hw, gpus=half)).fits, layout
    # splitting further lowers the peak: the same layout with twice the context parallel ranks
    wider = with_changes(run, parallel={**best.layout, "cp": best.layout["cp"] * 2, "pp": 1})
    assert estimate_eval(wider, replace(hw, gpus=best.gpus * 2)).peak < best.peak


def test_plan_eval_prints_both_plans_and_json():
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--config", "glm-5.3-flash-1m-64xb200", "--eval"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "eval of 1M-token windows on B200: 64 GPUs, tp=8 cp=2 ep=32 etp=2" in result.output
    assert "the fewest B200 GPUs that fit:" in result.output and "tokens/s" in result.output
    result = runner.invoke(app, ["plan", "--config", "glm-5.3-flash-512k-64xb200", "--eval", "--json", "--gpu", "H100"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["layout"]["seq_len"] == 1 << 19 and out["smallest"]["fits"]
    assert {i["name"].split(" ")[0] for i in out["smallest"]["memory"]} >= {"weights", "residual", "largest", "logits"}


def test_score_hours_are_the_tokens_the_overlapping_windows_read():
    """``plan --eval`` says how long ``genome-lm score`` takes over hg38 chr22 and the genome: the
    bases times window / (window - context) tokens at the plan's tokens/s, and the float16
    embeddings' bytes a layer; a context not inside the window is one line."""
    from genome_lm.errors import GenomeLMError
    from genome_lm.plan.eval_model import HG38_CHR22, HG38_GENOME, score_time

    run = load_config("glm-5.3-flash-1m-64xb200", [])
    best = smallest_eval_layout(run, _hw("B200"), gpu_spec("B200"))
    t = score_time(best, "chr22", HG38_CHR22, 1 << 16)
    assert t.tokens == pytest.approx(HG38_CHR22 * (1 << 20) / ((1 << 20) - (1 << 16)))
    assert t.hours == pytest.approx(t.tokens / best.tokens_per_s / 3600)
    assert t.embedding_bytes == HG38_CHR22 * model_config(run).hidden_size * 2
    for bad in (0, 1 << 20):
        with pytest.raises(GenomeLMError, match="--score-context"):
            score_time(best, "chr22", HG38_CHR22, bad)
    result = CliRunner().invoke(app, ["plan", "--config", "glm-5.3-flash-1m-64xb200", "--eval", "--json",
                                      "--score-context", "64k"])
    out = json.loads(result.output)
    chr22, genome = out["score"]["smallest"]
    assert out["score"]["context"] == 1 << 16 and chr22["hours"] == pytest.approx(t.hours)
    assert genome["bases"] == HG38_GENOME and genome["hours"] == pytest.approx(t.hours * HG38_GENOME / HG38_CHR22)
