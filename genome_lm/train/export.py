"""``genome-lm export``: a training checkpoint -> Hugging Face glm5_next safetensors.

A checkpoint that reshards (``checkpoint.sharded``: genome-lm's format 2, or one rank's) exports
in one process whatever layout wrote it, with no model built: each weight is assembled from its
pieces, renamed and written, one tensor and one output shard in memory at a time. A checkpoint of
the earlier per-rank format written by several ranks exports only under its own layout
(``torchrun`` with the same sizes), where each rank loads its shards and ``export_hf_checkpoint``
gathers them.

A LoRA run's checkpoint holds its adapters only (and names its base by path and digest): its base
is rebuilt as the run built it, the adapters are folded into the weights and the merged model is
written; with ``adapters=True`` (``--adapters``) the adapters alone are written in the Hugging Face
PEFT layout instead (``checkpoint.hf_peft``), for peft to load onto transformers' glm5_next.

The folder is written as ``<out>.partial`` and renamed when complete: an interrupted export leaves
no folder that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from genome_lm import weights
from genome_lm.errors import GenomeLMError
from genome_lm.model.config import ModelConfig


def export_run(run_dir: str | Path, out: str | Path, *, checkpoint: str | None = None,
               like: str | Path | None = None, max_shard_bytes: int = 5 * 2**30, adapters: bool = False) -> Path:
    from genome_lm.checkpoint import resolve, verify
    from genome_lm.checkpoint.training import reshards

    folder = resolve(run_dir, step=checkpoint, what="checkpoint to export").checkpoint
    if folder is None:
        raise GenomeLMError(f"{run_dir}: a Hugging Face folder already; export takes a training run or checkpoint")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise GenomeLMError(f"{out}: exists and is not empty; export into a new folder")
    meta = verify(folder)
    if adapters:
        return _export_adapters(folder, meta, out, like)
    partial = out.with_name(out.name + ".partial")
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0:
        shutil.rmtree(partial, ignore_errors=True)
    if "base" in meta:  # a LoRA run's adapters: merged into their rebuilt base
        _export_adapted(folder, meta, partial, like, max_shard_bytes)
    elif reshards(meta):
        _export_pieces(folder, meta, partial, like, max_shard_bytes)
    else:
        _export_under_layout(folder, meta, partial, like, max_shard_bytes)
    if rank0:
        (partial / "genome_lm_export.json").write_text(json.dumps({"run": str(run_dir), "checkpoint": folder.name,
                                                                   "step": meta["step"]}, indent=1))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(partial, out)
    return out


def _model_config(folder: Path, meta: dict):
    if "model_config" not in meta:
        raise GenomeLMError(f"{folder / 'meta.json'}: records no model config (not a checkpoint written by genome-lm "
                            "finetune)")
    return ModelConfig.from_hf(meta["model_config"])


def _export_pieces(folder: Path, meta: dict, out: Path, like, max_shard_bytes: int) -> None:
    """One process, no model: the weights streamed from the checkpoint's pieces."""
    from genome_lm.checkpoint.huggingface import export_full_tensors
    from genome_lm.checkpoint.sharded import full_model_tensors
    from genome_lm.checkpoint.training import piece_reader

    reader = piece_reader(folder, meta)
    try:
        export_full_tensors(full_model_tensors(reader), _model_config(folder, meta), out, like=like,
                            max_shard_bytes=max_shard_bytes)
    finally:
        reader.close()


def _export_adapters(folder: Path, meta: dict, out: Path, like) -> Path:
    """The adapters alone, as a Hugging Face PEFT folder for transformers' glm5_next
    (``checkpoint.hf_peft``), checked against the base's shapes when the base is a Hugging Face
    folder (or ``like`` names one)."""
    from genome_lm.checkpoint.hf_peft import export_peft_adapter
    from genome_lm.checkpoint.paths import training_checkpoint
    from genome_lm.checkpoint.sharded import full_model_tensors
    from genome_lm.checkpoint.training import piece_reader
    from genome_lm.config import RunConfig

    if "base" not in meta:
        raise GenomeLMError(f"{folder}: not a LoRA run's checkpoint (peft.method=none): --adapters exports the "
                            "adapters of a run with peft.method=lora")
    base = meta["base"].get("checkpoint")
    if like is None and base and training_checkpoint(found := Path(weights.resolve(str(base)))) is None:
        like = found  # the base is a Hugging Face folder: the adapters' shapes are checked against it
    peft = RunConfig.model_validate(meta["config"], strict=False).peft
    reader = piece_reader(folder, meta)
    try:
        return export_peft_adapter(full_model_tensors(reader, keep=lambda key: ".lora_" in key), peft,
                                   _model_config(folder, meta), out, like=like,
                                   base_model_name_or_path=str(base) if base else None)
    finally:
        reader.close()


def _export_adapted(folder: Path, meta: dict, out: Path, like, max_shard_bytes: int) -> None:
    """An adapter checkpoint: its base rebuilt as its run built it (and checked against the digest
    the checkpoint recorded), the adapters loaded and folded into the weights, the merged model
    written. One process, holding the whole model: a base too large for one process cannot be
    exported merged yet (``model.peft.merge_lora`` merges each rank's slices, but no split export
    of adapter checkpoints is wired up); its adapters export alone (``--adapters``)."""
    from genome_lm.checkpoint import build, load_weights
    from genome_lm.checkpoint.huggingface import export_hf_checkpoint
    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.peft import merge_lora

    cfg = RunConfig.model_validate(meta["config"], strict=False)
    with parallel_context() as pg:
        model = build(cfg, pg, ParallelSizes())
        load_weights(folder, model)
        merge_lora(model)
        export_hf_checkpoint(model, out, like=like, max_shard_bytes=max_shard_bytes)


def _export_under_layout(folder: Path, meta: dict, out: Path, like, max_shard_bytes: int) -> None:
    """The earlier per-rank format: every rank of the writing layout loads its files and the
    export gathers them (run under torchrun with that layout's ranks)."""
    from genome_lm.checkpoint import load_checkpoint
    from genome_lm.checkpoint.huggingface import export_hf_checkpoint
    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.model import build_model

    cfg = RunConfig.model_validate(meta["config"], strict=False)
    sizes = ParallelSizes(**meta["layout"])
    with parallel_context(sizes) as pg:
        model = build_model(_model_config(folder, meta), pg, sizes, kernel_backend="auto",
                            dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32)
        load_checkpoint(folder, model, None)
        export_hf_checkpoint(model, out, like=like, max_shard_bytes=max_shard_bytes)
