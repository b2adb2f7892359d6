"""What a user can name as a model to evaluate, and how it is built.

- a training run folder (``train.out_dir``): its latest checkpoint;
- one checkpoint folder (``<run>/checkpoints/step-000040``);
- a Hugging Face glm5_next folder (``config.json`` + safetensors, e.g. ``genome-lm export``);
- ``init`` (only as the baseline of a run or checkpoint): that run's starting weights, rebuilt
  from its config and seed as the trainer built them (the pretrained ``model.checkpoint`` when
  it had one, else the seeded random initialisation);
- ``preset:NAME``: a model preset with fresh weights seeded by ``seed`` (checks and tests);
- ``builtin:NAME``: weights shipped with genome-lm (``genome_lm.weights``), a Hugging Face folder.

Checkpoints are verified (sizes and checksums) before their weights are read; one written by
many ranks loads into this process's layout (``checkpoint.sharded``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from genome_lm import weights
from genome_lm.errors import GenomeLMError
from genome_lm.model import get_preset
from genome_lm.weights import shipped_name

from .schema import ModelInfo

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from genome_lm.engine.parallel import ParallelSizes


@dataclass
class LoadedModel:
    model: torch.nn.Module
    info: ModelInfo  # what was loaded: kind, path, step, preset ... (goes into the report)
    token_map: torch.Tensor | None = None
    run_dir: Path | None = None  # the training run it belongs to
    run_id: str | None = None  # its MLflow run
    config: object | None = field(default=None, repr=False)  # RunConfig of a training checkpoint


def load_model(spec: str | Path, pg: ProcessGroupCollection, *, init_of: LoadedModel | None = None,
               seed: int = 0, sizes: ParallelSizes | None = None) -> LoadedModel:
    """Build the model ``spec`` names (see the module docstring) in process groups ``pg``, split
    by ``sizes`` (default: one process). Seeded weights (``preset:``, and ``init`` without a
    pretrained start) are drawn as that layout draws them."""
    from genome_lm.checkpoint import build, load_weights, resolve, token_map, verify
    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes

    sizes = sizes or ParallelSizes()
    if str(spec).startswith("preset:"):
        from genome_lm.model.model import build_model

        name = str(spec)[len("preset:"):]
        try:
            cfg = get_preset(name)
        except ValueError as exc:
            raise GenomeLMError(str(exc)) from None
        torch.manual_seed(seed)
        model = build_model(cfg, pg, sizes)
        return LoadedModel(model.eval(), ModelInfo(kind="preset", path=str(spec), preset=name, seed=seed))
    if str(spec) == "init":
        if init_of is None or init_of.config is None:
            raise GenomeLMError("--baseline init needs --model to be a training run or checkpoint (its starting "
                                "weights are rebuilt from its config)")
        cfg = init_of.config
        torch.manual_seed(cfg.train.seed)  # the trainer seeds before building: the same initial weights
        model = build(cfg, pg, sizes)
        info = ModelInfo(kind="init", path=init_of.info.path, step=0, preset=cfg.model.preset,
                         checkpoint=cfg.model.checkpoint)
        return LoadedModel(model.eval(), info, token_map(cfg, model), init_of.run_dir, init_of.run_id, cfg)

    found = resolve(weights.resolve(str(spec)), what="model")  # builtin:NAME -> the shipped folder
    if found.checkpoint is not None:
        folder, run_dir = found.checkpoint, found.run_dir
        meta = verify(folder)
        cfg = RunConfig.model_validate(meta["config"], strict=False)
        cfg._source = meta.get("config_source")  # the YAML it was read from, for names
        model = build(cfg, pg, sizes)
        load_weights(folder, model)  # verified above; any layout it was written with (checkpoint.sharded)
        state = json.loads((folder / "state-r00000.json").read_text())
        info = ModelInfo(kind="checkpoint", path=str(folder), step=int(meta.get("step", state.get("step", 0))),
                         preset=cfg.model.preset, checkpoint=cfg.model.checkpoint)
        return LoadedModel(model.eval(), info, token_map(cfg, model), run_dir, state.get("run_id"), cfg)
    path = found.path  # a Hugging Face folder
    from genome_lm.checkpoint.huggingface import HFCheckpoint, load_hf_checkpoint
    from genome_lm.model.model import build_model

    ckpt = HFCheckpoint(path)
    model = build_model(ckpt.config(), pg, sizes)
    load_hf_checkpoint(model, path)
    mapping = None
    if model.cfg.vocab_size > 16:
        from genome_lm.data.vocab import checkpoint_token_map

        mapping = checkpoint_token_map(path, model.cfg.pad_token_id)

    info = ModelInfo(kind="huggingface", path=str(path), shipped=shipped_name(path),
                     model_type=json.loads((path / "config.json").read_text()).get("model_type"))
    return LoadedModel(model.eval(), info, mapping)
