"""The model a run configuration names, with its weights: what the trainer starts from and what
evaluation rebuilds (a run's starting weights, a checkpoint's architecture).

``model.checkpoint`` may name a Hugging Face glm5_next folder, a genome-lm training checkpoint or
a run folder (``paths.resolve``); without one the preset's seeded random initialisation is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from genome_lm.data.tokenizer import VOCAB_SIZE
from genome_lm.engine.backend import current
from genome_lm.errors import GenomeLMError
from genome_lm.model import get_preset
from genome_lm.model.config import ModelConfig

from .paths import training_checkpoint

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import GLM5Model


def build(cfg: RunConfig, pg: ProcessGroupCollection, sizes: ParallelSizes) -> GLM5Model:
    """Model (with weights) and its config, for a ``RunConfig``.

    ``model.checkpoint`` may name a Hugging Face glm5_next folder, a genome-lm training checkpoint
    (a folder with ``meta.json``) or a training run folder (its ``checkpoints/latest``). From a
    genome-lm checkpoint only the weights are taken (verified first; the caller starts a new run:
    fresh optimizer, step 0), under this run's parallel layout whatever layout wrote them; the
    architecture is the one it recorded, and its model preset must match this run's. The random
    generators are left as a random initialisation would leave them: the new run's seeding is its
    own."""
    from genome_lm.checkpoint.huggingface import HFCheckpoint, load_hf_checkpoint
    from genome_lm.model.model import build_model

    from .training import load_weights

    model_cfg = get_preset(cfg.model.preset)
    ckpt = run_ckpt = None
    if cfg.peft.method != "none" and not cfg.model.checkpoint:
        raise GenomeLMError(f"peft.method={cfg.peft.method} adapts a trained base: set model.checkpoint (a Hugging "
                            "Face folder, a genome-lm run or builtin:tiny-long); a randomly initialised base has "
                            "nothing to adapt")
    if cfg.model.checkpoint:
        run_ckpt = training_checkpoint(Path(cfg.model.checkpoint))
        if run_ckpt is not None:
            model_cfg = _check_start_checkpoint(run_ckpt, cfg, sizes)
        else:
            ckpt = HFCheckpoint(cfg.model.checkpoint)
            model_cfg = ckpt.config()

    impl = current().resolve_impl(cfg.model.transformer_impl)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    model = build_model(model_cfg, pg, sizes, transformer_impl=impl, kernel_backend=cfg.model.kernel_backend,
                        dtype=dtype, moe_aux_loss_coeff=cfg.train.moe_aux_loss_coeff,
                        moe_aux_loss=cfg.train.moe_aux_loss, compiled=cfg.model.compile)
    if ckpt is not None:
        load_hf_checkpoint(model, ckpt.path)
    if run_ckpt is not None:
        load_weights(run_ckpt, model)
    if cfg.peft.method == "lora":  # from outside, on the loaded base, before anything wraps the model
        from genome_lm.model.peft import apply_lora

        from .sharded import content_digest

        apply_lora(model, cfg.peft, seed=cfg.train.seed)
        model.base_digest = content_digest(model)  # what an adapter checkpoint names its base by
        model.base_source = cfg.model.checkpoint
    return model


def _check_start_checkpoint(folder: Path, cfg: RunConfig, sizes: ParallelSizes):
    """Verify a genome-lm checkpoint (every file against its checksum) and check that this run can
    load its weights: the same model preset (and, for the earlier per-rank format written by
    several ranks, the same parallel layout). Returns its model config."""
    from .training import reshards, verify, weight_layout

    meta = verify(folder)
    recorded = meta.get("config", {}).get("model", {})
    if "model_config" not in meta or "layout" not in meta or "preset" not in recorded:
        raise GenomeLMError(f"{folder}: meta.json records no model config, preset or layout "
                            "(not a checkpoint written by genome-lm finetune)")
    if recorded["preset"] != cfg.model.preset:
        raise GenomeLMError(f"{folder}: trained with model preset {recorded['preset']!r}, this run has "
                            f"{cfg.model.preset!r} (set model.preset to {recorded['preset']!r})")
    if meta["config"].get("peft", {}).get("method", "none") != "none":
        raise GenomeLMError(f"{folder}: a LoRA run's checkpoint (its adapters beside its base) cannot yet be the start "
                            "of another run; start from its base, or resume it with --resume")
    if not reshards(meta):
        ours = weight_layout(vars(sizes))
        theirs = {k: meta["layout"].get(k) for k in ours}
        world = dist.get_world_size() if dist.is_initialized() else 1
        if theirs != ours or meta.get("world_size") != world:
            def show(layout, n):
                return " ".join(f"{k}={v}" for k, v in layout.items()) + f" on {n} rank(s)"

            raise GenomeLMError(f"{folder}: written in genome-lm's earlier per-rank format with parallel layout "
                                f"{show(theirs, meta.get('world_size'))}, this run has {show(ours, world)}; resume "
                                "it once with its own layout (its next checkpoint loads under any layout) or export "
                                f"it (genome-lm export --run {folder.parent.parent} --checkpoint {folder.name} "
                                "--out DIR) and start from that")
    try:
        return ModelConfig.from_hf(meta["model_config"])
    except (ValueError, TypeError) as exc:
        raise GenomeLMError(f"{folder / 'meta.json'}: model_config: {exc}") from None


def token_map(cfg: RunConfig, model: GLM5Model) -> torch.Tensor | None:
    """genome-lm id -> model id, when the model has a text vocabulary of its own (a pretrained
    checkpoint): bases become its single-letter tokens (``data.vocab``). None for DNA vocabularies."""
    if model.cfg.vocab_size <= 16 and model.cfg.vocab_size >= VOCAB_SIZE:
        return None
    if not cfg.model.checkpoint:
        raise GenomeLMError(f"model vocabulary of {model.cfg.vocab_size} tokens is not genome-lm's DNA vocabulary, and "
                            "there is no checkpoint tokenizer to map bases onto it")
    from genome_lm.data.vocab import checkpoint_token_map

    return checkpoint_token_map(_tokenizer_folder(Path(cfg.model.checkpoint)), model.cfg.pad_token_id)


def _tokenizer_folder(path: Path) -> Path:
    """Where the tokenizer of ``model.checkpoint`` lives: the folder itself for a Hugging Face
    checkpoint; for a genome-lm run or checkpoint, that of the checkpoint its run started from
    (recorded in its meta.json), followed back to the Hugging Face folder."""
    seen = set()
    while (folder := training_checkpoint(path)) is not None:
        if folder in seen:
            raise GenomeLMError(f"{path}: its runs' model.checkpoint entries form a loop")
        seen.add(folder)
        source = json.loads((folder / "meta.json").read_text()).get("config", {}).get("model", {}).get("checkpoint")
        if not source:
            raise GenomeLMError(f"{folder}: the model has a text vocabulary but its run recorded no pretrained "
                                "checkpoint to take the tokenizer from")
        path = Path(source)
    return path
