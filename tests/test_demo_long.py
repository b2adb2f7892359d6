"""``genome-lm demo --long`` wiring, at a small scale and a few steps (the recipe's figures are
measured by running it, see docs/demo.md)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_the_long_recipe_runs_both_stages_and_reports_ablation_and_selection(tmp_path):
    from genome_lm.demo import LONG_MAX_CONTEXTS, run_long_demo

    out = tmp_path / "long"
    stage1 = ["train.steps=2", "train.save_every=0", "train.global_batch_size=2", "train.micro_batch_size=2"]
    stage2 = ["train.steps=3", "train.save_every=0", "data.seq_len_warmup=[[0, 256], [2, 512]]", "data.seq_len=512"]
    result = run_long_demo(out, overrides=(stage1, stage2), eval_windows=1, scale=0.05, progress=False)
    first, second = result.stages
    assert first.steps_done == 2 and second.steps_done == 3
    drill = json.loads((out / "drill" / "manifest.json").read_text())
    assert list(drill["splits"]) == ["train"]
    assert [c["record"] for c in drill["splits"]["train"]["chromosomes"]] == ["drill"]
    main = json.loads((out / "dataset" / "manifest.json").read_text())
    assert [c["record"] for c in main["splits"]["train"]["chromosomes"]] == ["chr1", "chr2", "drill"]
    meta = json.loads((second.checkpoint / "meta.json").read_text())
    assert meta["config"]["model"]["checkpoint"] == str(out / "drill-run")  # stage 2 starts from stage 1's model
    report = result.report
    assert [cut.max_context for cut in report.ablation.cuts] == LONG_MAX_CONTEXTS
    (layer,) = result.selection
    assert layer.layer == 3 and 0 <= layer.hits <= layer.copies


@pytest.mark.parametrize("reason", ["SIGTERM", "non-finite loss"])
def test_a_stage_stopped_early_ends_the_demo_before_the_next_stage(tmp_path, monkeypatch, reason):
    from genome_lm.demo import run_long_demo
    from genome_lm.errors import GenomeLMError
    from genome_lm.train import trainer

    started = []

    def stopped_train(cfg, **kwargs):
        started.append(cfg.train.out_dir)
        return trainer.TrainResult(out_dir=cfg.train.out_dir, steps_done=7, stopped_by=reason)

    monkeypatch.setattr(trainer, "train", stopped_train)
    with pytest.raises(GenomeLMError, match=f"stopped by {reason} at step 7; run the same command again"):
        run_long_demo(tmp_path / "long", scale=0.05, progress=False)
    assert started == [str(tmp_path / "long" / "drill-run")]  # stage 2 never started
