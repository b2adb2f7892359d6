"""Hugging Face glm5_next checkpoints <-> genome-lm's megatron-core model, any parallel layout.

The checkpoint format is what transformers' ``save_pretrained`` writes for
``Glm5NextForConditionalGeneration`` (and what the released checkpoint uses): safetensors files,
sharded with ``model.safetensors.index.json``, text weights under ``model.language_model.`` (or
``model.`` for a text-only checkpoint), ``lm_head.weight`` at the top, experts as one tensor per
expert and projection, hyper-connections as ``hc_attn_fn`` / ``hc_attn_base`` / ....
Vision weights are ignored.

Two steps, in both directions:
1. names: each model parameter corresponds to one or more checkpoint tensors at full size
   (``_full_from_hf`` / ``_full_to_hf``): for instance megatron-core's ``linear_fc1`` is
   ``[gate; up]`` and genome-lm's KDA ``conv_weight`` is ``[q; k; v]`` convolutions.
2. layout: a rank holds a slice of the full tensor along ``partition_dim`` in its tensor (or
   expert-tensor) parallel group, and experts ``ep_rank * local + j``; the slicing, gathers and
   the pipeline stages' transfers to rank 0 are ``genome_lm.engine.layout``'s.

Loading reads one checkpoint tensor at a time through memory-mapped ``safe_open`` and copies
the local slice into the parameter, so the weights are never held twice. Export gathers one
parameter at a time and writes shards of at most ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open

from genome_lm.engine.layout import ep_gather, expert_offset, to_rank0, tp_gather, tp_slice
from genome_lm.errors import GenomeLMError
from genome_lm.model.config import ModelConfig

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(GenomeLMError, ValueError):
    """A checkpoint that cannot be read as glm5_next (names the file and what is wrong)."""


class HFCheckpoint:
    """Read access to the tensors of a safetensors checkpoint folder, one at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if (self.path / INDEX).exists():
            try:
                weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{self.path / INDEX}: not a safetensors index ({exc})") from None
        elif (self.path / SINGLE).exists():
            with safe_open(self.path / SINGLE, "pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise CheckpointError(f"{self.path}: no {INDEX} or {SINGLE}")
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open
        self._handles: dict[str, object] = {}
        self.prefix = self._text_prefix()

    def _text_prefix(self) -> str:
        for prefix in ("model.language_model.", "model.", ""):
            if prefix + "embed_tokens.weight" in self.weight_map:
                return prefix
        raise CheckpointError(f"{self.path}: no embed_tokens.weight: not a glm5_next checkpoint")

    def config(self) -> ModelConfig:
        file = self.path / "config.json"
        if not file.exists():
            raise CheckpointError(f"{file}: missing")
        try:
            return ModelConfig.from_hf(file)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{file}: {exc}") from None

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def _handle(self, key: str):
        """The open file that holds ``key``."""
        if key not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor {key} is missing")
        file = self.weight_map[key]
        if file not in self._handles:
            if not (self.path / file).exists():
                raise CheckpointError(f"{self.path / file}: missing (listed in the index)")
            self._handles[file] = self._open(self.path / file, "pt")
        return self._handles[file]

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def dtype_of(self, key: str) -> torch.dtype:
        return self.get(key).dtype

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (the tensor is not read)."""
        return tuple(self._handle(key).get_slice(key).get_shape())

    def close(self) -> None:
        self._handles.clear()


# ------------------------------------------------------------------------------ names, full size
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")

# parameter (inside a layer) -> checkpoint tensor (inside the layer), one to one
_SAME_IN_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "self_attention.o_norm_weight": "self_attn.o_norm.weight",
    "self_attention.A_log": "self_attn.A_log",
    "self_attention.dt_bias": "self_attn.dt_bias",
}
for _hc in ("attn", "ffn"):
    for _p in ("fn", "base", "scale"):
        _SAME_IN_LAYER[f"{_hc}_hc.{_p}"] = f"hc_{_hc}_{_p}"
_GLU = {"mlp.linear_fc1.weight": "mlp", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts"}
_DOWN = {"mlp.linear_fc2.weight": "mlp.down_proj.weight",
         "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight"}


def _top_level(name: str, cfg: ModelConfig, prefix: str) -> list[str]:
    if name == "embedding.weight":
        return [prefix + "embed_tokens.weight"]
    if name == "final_norm.weight":
        return [prefix + "norm.weight"]
    if name == "output_layer.weight":
        return [prefix + "embed_tokens.weight"] if cfg.tie_word_embeddings else ["lm_head.weight"]
    raise KeyError(name)


def hf_keys(name: str, cfg: ModelConfig, prefix: str, expert_offset: int = 0) -> list[str]:
    """Checkpoint tensors that make up parameter ``name`` (in order of concatenation)."""
    m = _LAYER.fullmatch(name)
    if not m:
        return _top_level(name, cfg, prefix)
    layer, rest = m.group(1), m.group(2)
    base = f"{prefix}layers.{layer}."
    if rest in _SAME_IN_LAYER:
        return [base + _SAME_IN_LAYER[rest]]
    if rest in _GLU:
        return [f"{base}{_GLU[rest]}.gate_proj.weight", f"{base}{_GLU[rest]}.up_proj.weight"]
    if rest in _DOWN:
        return [base + _DOWN[rest]]
    if (e := _EXPERT.fullmatch(rest)) is not None:
        expert = int(e.group(1)) + expert_offset
        if e.group(2) == "linear_fc1":
            return [f"{base}mlp.experts.{expert}.gate_proj.weight", f"{base}mlp.experts.{expert}.up_proj.weight"]
        return [f"{base}mlp.experts.{expert}.down_proj.weight"]
    if rest == "self_attention.conv_weight":
        return [f"{base}self_attn.{p}_conv1d.weight" for p in "qkv"]
    if rest.startswith("self_attention."):
        return [base + "self_attn." + rest[len("self_attention."):]]
    raise KeyError(name)


def _full_from_hf(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Checkpoint tensors -> the parameter at tensor-parallel size 1."""
    if name.endswith("self_attention.conv_weight"):  # 3 x [W, 1, k] -> [3, W, k]
        return torch.stack([t.squeeze(1) for t in tensors])
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _full_to_hf(name: str, full: torch.Tensor) -> list[torch.Tensor]:
    if name.endswith("self_attention.conv_weight"):
        return [t.unsqueeze(1).contiguous() for t in full.unbind(0)]
    if name.endswith("linear_fc1.weight"):
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    return [full]


# ---------------------------------------------------------------------------------------- layout
def is_glu(name: str) -> bool:
    """A GLU ``linear_fc1`` weight: ``[gate; up]`` stacked along dimension 0."""
    return name.endswith("linear_fc1.weight")


def groups_of(model: GLM5Model, name: str):
    """(tensor-parallel group of this parameter, expert-parallel group or None)."""
    if ".experts.local_experts." in name:
        return model.pg.expt_tp, model.pg.ep
    return model.pg.tp, None


def _weights(model: GLM5Model):
    """(name, tensor) of everything a checkpoint holds on this rank: parameters and the router's
    expert bias, named with the model's layer numbers (``GLM5Model.global_name``)."""
    rename = getattr(model, "global_name", lambda name: name)
    for name, param in model.named_parameters():
        yield rename(name), param
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            yield rename(name), buf


# ---------------------------------------------------------------------------------- load, export
@torch.no_grad()
def load_hf_checkpoint(model: GLM5Model, path: str | Path, *, check_config: bool = True) -> None:
    """Copy the checkpoint's text weights into ``model`` (any tensor / expert parallel layout).

    Streams file by file: each safetensors file is opened (memory-mapped), the tensors this rank
    needs are copied into their parameters, and the file is closed before the next one, so
    memory holds the model plus at most the pieces of parameters split across files."""
    ckpt = HFCheckpoint(path)
    if check_config:
        cfg = ckpt.config()
        if cfg != model.cfg:
            diff = {f: (getattr(cfg, f), getattr(model.cfg, f)) for f in cfg.__dataclass_fields__
                    if getattr(cfg, f) != getattr(model.cfg, f)}
            raise CheckpointError(f"{ckpt.path / 'config.json'}: does not match the model (checkpoint, model): {diff}")
    targets = dict(_weights(model))
    wanted: dict[str, list[str]] = {}
    owner: dict[str, list[str]] = {}  # checkpoint key -> parameters that need it
    for name in targets:
        first_expert = expert_offset(model.cfg.n_routed_experts, groups_of(model, name)[1])
        keys = hf_keys(name, model.cfg, ckpt.prefix, first_expert)
        missing = [k for k in keys if not ckpt.has(k)]
        if missing:
            raise CheckpointError(f"{ckpt.path}: tensor {missing[0]} is missing (needed for {name})")
        wanted[name] = keys
        for key in keys:
            owner.setdefault(key, []).append(name)
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    by_file: dict[str, list[str]] = {}
    for key in owner:
        by_file.setdefault(ckpt.weight_map[key], []).append(key)
    try:
        for file, keys in sorted(by_file.items()):
            for key in keys:
                tensor = ckpt.get(key)
                for name in owner[key]:
                    got = pieces.setdefault(name, {})
                    got[key] = tensor
                    if len(got) == len(wanted[name]):
                        _copy_into(targets[name], name, [got[k] for k in wanted[name]], model, ckpt)
                        del pieces[name]
                del tensor
            ckpt.close()  # unmap this file before opening the next
    finally:
        ckpt.close()


def _stage_tensors(model: GLM5Model, prefix: str):
    """(checkpoint key, full tensor) of this pipeline stage's weights, gathered over the tensor
    and expert parallel ranks (collective within the stage: every rank of it iterates)."""
    for name, param in _weights(model):
        tp_group, ep_group = groups_of(model, name)
        full = tp_gather(param.detach(), param, tp_group, glu=is_glu(name))
        experts = ep_gather(full, ep_group)
        local_count = model.cfg.n_routed_experts // len(experts)
        for ep_rank, tensor in enumerate(experts):
            keys = hf_keys(name, model.cfg, prefix, ep_rank * local_count)
            yield from zip(keys, _full_to_hf(name, tensor))


def _copy_into(param: torch.Tensor, name: str, tensors: list[torch.Tensor], model: GLM5Model,
               ckpt: HFCheckpoint) -> None:
    full = _full_from_hf(name, tensors)
    tp_group, _ = groups_of(model, name)
    if full.dim() != param.dim() or (tp_group.size() == 1 and full.shape != param.shape):
        raise CheckpointError(f"{ckpt.path}: {hf_keys(name, model.cfg, ckpt.prefix)[0]} has shape "
                              f"{tuple(full.shape)}, which does not fit {name} {tuple(param.shape)}")
    local = tp_slice(full, param, tp_group, glu=is_glu(name))
    if local.shape != param.shape:
        raise CheckpointError(f"{ckpt.path}: {hf_keys(name, model.cfg, ckpt.prefix)[0]} has shape "
                              f"{tuple(full.shape)}, which does not fit {name} {tuple(param.shape)} at this layout")
    param.copy_(local)


def text_prefix(like: str | Path | None) -> str:
    """The text weights' prefix of an exported checkpoint: that of ``like`` when given, else
    transformers' for ``Glm5NextForConditionalGeneration``."""
    return HFCheckpoint(like).prefix if like is not None else "model.language_model."


def _honour_umask(path: Path) -> None:
    """safetensors creates its files with mode 0600; give them the mode every other file of the
    export has (0666 less the umask), so whoever can read the folder can read the weights."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


class HFWriter:
    """Writes (checkpoint key, tensor) pairs as a glm5_next safetensors folder: shards of at most
    ``max_shard_bytes``, then the index and ``config.json``. Each tensor keeps the dtype it has in
    ``like`` (a checkpoint folder), else ``dtype``, else its own; ``config.json`` comes from
    ``like`` when given, else from ``cfg``. Memory: at most one shard's tensors at a time."""

    def __init__(self, out: str | Path, cfg: ModelConfig, *, dtype: torch.dtype | None = None,
                 like: str | Path | None = None, max_shard_bytes: int = 5 * 2**30):
        self.out, self.cfg, self.dtype, self.like, self.max_shard_bytes = Path(out), cfg, dtype, like, max_shard_bytes
        self.source = HFCheckpoint(like) if like is not None else None
        self.prefix = text_prefix(like)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes, self.files, self.weight_map = 0, [], {}

    def add(self, key: str, t: torch.Tensor) -> None:
        source = self.source
        want = source.dtype_of(key) if source is not None and source.has(key) else (self.dtype or t.dtype)
        t = t.to(want).contiguous().clone()
        if self.pending and self.pending_bytes + t.numel() * t.element_size() > self.max_shard_bytes:
            self._flush()
        self.pending[key] = t
        self.pending_bytes += t.numel() * t.element_size()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            file = f"model-{len(self.files) + 1:05d}.safetensors"
            self.out.mkdir(parents=True, exist_ok=True)
            save_file(self.pending, str(self.out / file), metadata={"format": "pt"})
            _honour_umask(self.out / file)
            self.files.append(file)
            self.weight_map.update({k: file for k in self.pending})
            self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self._flush()
        out, total, renamed = self.out, len(self.files), {}
        out.mkdir(parents=True, exist_ok=True)
        for i, file in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            (out / file).rename(out / final)
            renamed[file] = final
        index = {"metadata": {"format": "genome-lm export"},
                 "weight_map": {k: renamed[f] for k, f in sorted(self.weight_map.items())}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
        if self.like is not None and (Path(self.like) / "config.json").exists():
            config = json.loads((Path(self.like) / "config.json").read_text())
        else:
            config = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"],
                      "text_config": self.cfg.to_hf()}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        if self.source is not None:
            self.source.close()


@torch.no_grad()
def export_hf_checkpoint(model: GLM5Model, out: str | Path, *, dtype: torch.dtype | None = None,
                         like: str | Path | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write the model's weights as a glm5_next safetensors checkpoint (collective: call on every
    rank; rank 0 writes). Dtypes and ``config.json`` as ``HFWriter``'s."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    writer = HFWriter(out, model.cfg, dtype=dtype, like=like, max_shard_bytes=max_shard_bytes) if rank0 else None
    prefix = text_prefix(like)
    for key, tensor in to_rank0(_stage_tensors(model, prefix), model.pg.pp):
        writer.add(key, tensor)
    if writer is not None:
        writer.finish()


@torch.no_grad()
def export_full_tensors(tensors, cfg: ModelConfig, out: str | Path, *, dtype: torch.dtype | None = None,
                        like: str | Path | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write (name, whole tensor) pairs named as a one-process model's parameters (experts by
    their global index), e.g. ``checkpoint.sharded.full_model_tensors``, as a glm5_next folder.
    One process, no model: memory holds one tensor and one output shard at a time."""
    writer = HFWriter(out, cfg, dtype=dtype, like=like, max_shard_bytes=max_shard_bytes)
    for name, tensor in tensors:
        for key, part in zip(hf_keys(name, cfg, writer.prefix), _full_to_hf(name, tensor)):
            writer.add(key, part)
        del tensor
    writer.finish()
