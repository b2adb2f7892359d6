"""``genome-lm export``: a training checkpoint -> Hugging Face glm5_next safetensors.

Run it with the layout the checkpoint was written with (one process for a single-process run;
``torchrun`` with the same sizes for a parallel one): each rank loads its shards and
``export_hf_checkpoint`` gathers them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from genome_lm.errors import GenomeLMError


def export_run(run_dir: str | Path, out: str | Path, *, checkpoint: str | None = None,
               like: str | Path | None = None) -> Path:
    from genome_lm.checkpoint import load_checkpoint, resolve, verify
    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.config import ModelConfig
    from genome_lm.checkpoint.huggingface import export_hf_checkpoint
    from genome_lm.model.model import build_model

    folder = resolve(run_dir, step=checkpoint, what="checkpoint to export").checkpoint
    if folder is None:
        raise GenomeLMError(f"{run_dir}: a Hugging Face folder already; export takes a training run or checkpoint")
    meta = verify(folder)
    cfg = RunConfig.model_validate(meta["config"], strict=False)
    sizes = ParallelSizes(**meta["layout"])
    model_cfg = ModelConfig.from_hf(meta["model_config"])
    with parallel_context(sizes) as pg:
        model = build_model(model_cfg, pg, sizes, kernel_backend="auto",
                            dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32)
        load_checkpoint(folder, model, None)
        export_hf_checkpoint(model, out, like=like)
    (Path(out) / "genome_lm_export.json").write_text(json.dumps({"run": str(run_dir), "checkpoint": folder.name,
                                                                 "step": meta["step"]}, indent=1))
    return Path(out)

