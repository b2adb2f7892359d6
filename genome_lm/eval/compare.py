"""Base vs fine-tuned on the same evaluation tokens (what `genome-lm demo` prints)."""

from __future__ import annotations

from pathlib import Path

import torch


def compare_run(run_dir: str | Path, *, split: str | None = None, max_windows: int | None = 8) -> dict:
    """Score the run's starting model and its latest checkpoint on the same windows of the
    evaluation split; returns overall and per-context-bucket mean losses for both."""
    from genome_lm.config import RunConfig
    from genome_lm.data.manifest import Manifest
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.train.checkpoint import latest_checkpoint, load_checkpoint, verify
    from genome_lm.train.trainer import build

    from .score import bucket_means, power_of_two_buckets, score_split

    folder = latest_checkpoint(run_dir)
    meta = verify(folder)
    cfg = RunConfig.model_validate(meta["config"], strict=False)
    split = split or cfg.data.eval_split
    windows = Manifest.load(Path(cfg.data.dataset)).split(split).windows
    seq_len = max(w.length for w in windows)
    sizes = ParallelSizes()
    with parallel_context(sizes) as pg:
        torch.manual_seed(cfg.train.seed)  # the trainer's initialisation: the base model
        base = build(cfg, pg, sizes)
        tuned = build(cfg, pg, sizes)
        load_checkpoint(folder, tuned, None)
        scores = {name: score_split(model, cfg.data.dataset, split, seq_len=seq_len, max_windows=max_windows)
                  for name, model in (("base", base), ("tuned", tuned))}
    buckets = power_of_two_buckets(seq_len)
    rows = []
    for b, t in zip(bucket_means(scores["base"], buckets), bucket_means(scores["tuned"], buckets)):
        if b["tokens"]:
            rows.append({**b, "base": b.pop("loss"), "tuned": t["loss"]})
    return {"split": split, "windows": len(set(scores["base"].window.tolist())), "tokens": int(scores["base"].nll.size),
            "base": scores["base"].mean, "tuned": scores["tuned"].mean, "buckets": rows, "checkpoint": str(folder)}

