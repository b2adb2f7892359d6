"""LoRA adapters alone, as a Hugging Face PEFT folder for transformers' glm5_next.

``export_peft_adapter`` writes ``adapter_config.json`` and ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(glm5_next_model, folder)`` loads onto the base model (the
glm5_next checkpoint the run fine-tuned, or its ``genome-lm export`` without the adapters merged).

Each genome-lm adapter (``genome_lm.model.peft``: ``lora_a`` [r, in], ``lora_b`` [out, r], the
update ``alpha / r * lora_b @ lora_a``) becomes peft's ``lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] on the module transformers' model holds in memory; peft's scale is the
same ``lora_alpha / r``. Every mapping below is exact (the adapted model computes the same
function, up to the rounding of the order of operations):

- a projection with one checkpoint tensor: the module of that tensor (``hf_keys``), under its
  in-memory name (the KDA forget gate's ``f_a_proj`` / ``f_b_proj`` live in ``forget_gate``);
  ``output_layer`` is ``lm_head``;
- a dense or shared-expert GLU ``linear_fc1`` (``[gate; up]``, one ``lora_a`` for both halves):
  ``gate_proj`` and ``up_proj`` each get the same ``lora_A`` and their half of ``lora_B``;
- routed experts: transformers holds them as two 3-d parameters per layer,
  ``mlp.experts.gate_up_proj`` [E, 2 F, H] (gate then up) and ``mlp.experts.down_proj``
  [E, H, F], which peft adapts through ``target_parameters`` (its ``ParamWrapper``: one adapter
  of rank r per expert, ``lora_A`` [E r, in] expert-major, ``lora_B`` [out, r E] rank-major,
  expert e's update ``scaling * lora_B[:, k E + e] @ lora_A[e r + k]`` summed over k). An expert
  without an adapter (a target pattern that names some experts only) gets zeros, which adds
  nothing. When both parameters of a layer are adapted, peft nests the two wrappers, the
  ``gate_up_proj`` one inside (``experts.base_layer.lora_*``) and the ``down_proj`` one outside
  (``experts.lora_*``); with one of them only, it is ``experts.lora_*``.

Keys are ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``; ``target_modules``
lists every adapted module by its whole name and ``target_parameters`` every adapted expert
parameter, so peft adapts exactly these. peft refuses dropout on parameter targets: with routed
experts adapted, ``lora_dropout`` is written as 0 (dropout acts only in training; the adapted
model's output is the same). A run that also trained base tensors whole (``peft.train``) is
refused: the adapters alone are not its model.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from genome_lm.checkpoint.huggingface import HFCheckpoint, _honour_umask, hf_keys
from genome_lm.errors import GenomeLMError
from genome_lm.model.config import ModelConfig

if TYPE_CHECKING:
    from genome_lm.config import PeftConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what peft's PeftModel puts before the base model's module names
MODULE_PREFIX = "model.language_model."  # the text model's modules in Glm5NextForConditionalGeneration

# checkpoint tensor's module -> the module transformers' glm5_next holds it in (its load-time renaming)
_IN_MEMORY = (("self_attn.f_a_proj", "self_attn.forget_gate.f_a_proj"),
              ("self_attn.f_b_proj", "self_attn.forget_gate.f_b_proj"))
_STEM = re.compile(r"(.+)\.(lora_a|lora_b)")
_ROUTED = re.compile(r"layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)")
_GLU = re.compile(r"layers\.(\d+)\.(mlp|mlp\.shared_experts)\.linear_fc1")
_FC2 = re.compile(r"layers\.(\d+)\.(mlp|mlp\.shared_experts)\.linear_fc2")
# the other projections of genome-lm's layers (KDA, MLA, the DSA indexer), each one glm5_next nn.Linear
_ATTENTION = re.compile(r"layers\.\d+\.self_attention\.(?:(?:[qkvob]|[fg]_[ab]|q_[ab]|kv_b)_proj|kv_a_proj_with_mqa"
                        r"|indexer\.(?:wq_b|wk|weights_proj))")


def _in_memory(module: str) -> str:
    for old, new in _IN_MEMORY:
        if module.endswith("." + old):
            return module[:-len(old)] + new
    return module


def hf_module(name: str, cfg: ModelConfig, prefix: str) -> str:
    """The module of transformers' glm5_next (its name in memory, under the text ``prefix``) that
    genome-lm's projection ``name`` (a whole-model module name, no ``.weight``) is, for a
    projection with one checkpoint tensor (not a GLU ``linear_fc1`` nor a routed expert)."""
    if name == "output_layer":
        return "lm_head"
    if _ATTENTION.fullmatch(name) is None and _FC2.fullmatch(name) is None:
        raise GenomeLMError(f"adapter {name}: no linear module of glm5_next corresponds to it")
    (key,) = hf_keys(name + ".weight", cfg, prefix)
    return _in_memory(key.removesuffix(".weight"))


def _pairs(tensors) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> {"lora_a": ..., "lora_b": ...}; both must be there."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        m = _STEM.fullmatch(name)
        if m is None:
            raise GenomeLMError(f"{name}: not an adapter tensor (names end in .lora_a or .lora_b)")
        found.setdefault(m.group(1), {})[m.group(2)] = tensor
    for stem, pair in found.items():
        for part in ("lora_a", "lora_b"):
            if part not in pair:
                raise GenomeLMError(f"adapter tensor {stem}.{part} is missing (its "
                                    f"{'lora_b' if part == 'lora_a' else 'lora_a'} is there)")
    if not found:
        raise GenomeLMError("no adapter tensors to write (a run without peft.method=lora?)")
    return found


def _check(stem: str, a: torch.Tensor, b: torch.Tensor, r: int, out: int | None,
           n_in: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_a [r, in], lora_b [out, r]) of one adapter, its shapes checked (a GLU ``lora_b``
    [2, F, r] flattened to [2 F, r], its halves in [gate; up] order)."""
    if b.dim() == 3 and b.shape[0] == 2:
        b = b.reshape(-1, b.shape[-1])
    want_a = (r, n_in if n_in is not None else (a.shape[-1] if a.dim() == 2 else -1))
    want_b = (out if out is not None else (b.shape[0] if b.dim() == 2 else -1), r)
    if a.dim() != 2 or tuple(a.shape) != want_a:
        raise GenomeLMError(f"adapter tensor {stem}.lora_a has shape {tuple(a.shape)}, expected {want_a} (rank {r})")
    if b.dim() != 2 or tuple(b.shape) != want_b:
        raise GenomeLMError(f"adapter tensor {stem}.lora_b has shape {tuple(b.shape)}, expected {want_b} (rank {r})")
    return a, b


class _Base:
    """The (out, in) shape of each adapted projection's base weight (a GLU fc1's gate and up
    together): from the base checkpoint folder ``like`` when given, else what the model config
    fixes (the MLPs' and experts'), else unknown (None)."""

    def __init__(self, cfg: ModelConfig, like: str | Path | None):
        self.cfg = cfg
        self.ckpt = HFCheckpoint(like) if like is not None else None

    def shape(self, stem: str) -> tuple[int | None, int | None]:
        if self.ckpt is not None:
            keys = hf_keys(stem + ".weight", self.cfg, self.ckpt.prefix)
            missing = [k for k in keys if not self.ckpt.has(k)]
            if missing:
                raise GenomeLMError(f"{self.ckpt.path}: tensor {missing[0]} is missing: not the base model of "
                                    f"adapter {stem}")
            shapes = [self.ckpt.shape(k) for k in keys]
            return sum(s[0] for s in shapes), shapes[0][-1]
        cfg = self.cfg
        if (m := _ROUTED.fullmatch(stem)) is not None:
            glu, width = m.group(3) == "linear_fc1", cfg.moe_intermediate_size
        elif (m := _GLU.fullmatch(stem) or _FC2.fullmatch(stem)) is not None:
            glu = stem.endswith("linear_fc1")
            width = cfg.intermediate_size if m.group(2) == "mlp" else cfg.moe_intermediate_size * cfg.n_shared_experts
        else:
            return None, None
        return (2 * width, cfg.hidden_size) if glu else (cfg.hidden_size, width)


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def peft_adapter_tensors(tensors, peft: PeftConfig, cfg: ModelConfig, *, prefix: str = MODULE_PREFIX,
                         like: str | Path | None = None) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(peft state dict, target_modules, target_parameters) of the whole-model adapter tensors
    ``tensors``, modules named under ``prefix`` (see ``export_peft_adapter``); writes nothing."""
    r, pairs = peft.rank, _pairs(tensors)
    base = _Base(cfg, like)
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []

    def add(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        modules.append(module)
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b

    routed: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for stem, pair in sorted(pairs.items()):
        if (m := _ROUTED.fullmatch(stem)) is not None:
            layer, expert, fc = int(m.group(1)), int(m.group(2)), m.group(3)
            if expert >= cfg.n_routed_experts:
                raise GenomeLMError(f"adapter {stem}: the model has {cfg.n_routed_experts} routed experts")
            routed.setdefault((layer, fc), {})[expert] = _check(stem, pair["lora_a"], pair["lora_b"], r,
                                                                *base.shape(stem))
        elif _GLU.fullmatch(stem) is not None:  # gate_proj and up_proj: the same A, each its half of B
            a, b = _check(stem, pair["lora_a"], pair["lora_b"], r, *base.shape(stem))
            for key, half in zip(hf_keys(stem + ".weight", cfg, prefix), b.chunk(2, dim=0)):
                add(key.removesuffix(".weight"), a, half)
        else:
            module = hf_module(stem, cfg, prefix)  # refuses a name that is no projection
            add(module, *_check(stem, pair["lora_a"], pair["lora_b"], r, *base.shape(stem)))
    parameters: list[str] = []
    for (layer, fc), experts in sorted(routed.items()):
        both = (layer, "linear_fc1") in routed and (layer, "linear_fc2") in routed
        container = f"{prefix}layers.{layer}.mlp.experts"
        # peft nests gate_up_proj's wrapper inside down_proj's when both are adapted
        holder = container + (".base_layer" if fc == "linear_fc1" and both else "")
        a_all, b_all = _stack_experts(layer, fc, experts, peft, cfg)
        parameters.append(f"{container}.{'gate_up_proj' if fc == 'linear_fc1' else 'down_proj'}")
        out[f"{PEFT_PREFIX}{holder}.lora_A.weight"] = a_all
        out[f"{PEFT_PREFIX}{holder}.lora_B.weight"] = b_all
    return out, sorted(modules), parameters


def _stack_experts(layer: int, fc: str, experts: dict[int, tuple[torch.Tensor, torch.Tensor]], peft: PeftConfig,
                   cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's routed experts' adapters of ``fc`` as peft's ``ParamWrapper`` holds them:
    ``lora_A`` [E r, in] (expert e's rows e r ... e r + r - 1), ``lora_B`` [out, r E] (expert e's
    columns e, E + e, ...); an expert with no adapter gets zeros."""
    r, n = peft.rank, cfg.n_routed_experts
    a0, b0 = next(iter(experts.values()))
    a_list, b_list = [], []
    for e in range(n):
        name = f"layers.{layer}.mlp.experts.local_experts.{e}.{fc}"
        if e not in experts:
            if _matches(name, peft.targets):
                raise GenomeLMError(f"adapter tensor {name}.lora_a is missing (peft.targets names it; the layer's "
                                    "other experts have theirs)")
            a_list.append(torch.zeros_like(a0))
            b_list.append(torch.zeros_like(b0))
            continue
        a, b = experts[e]
        a_list.append(a)
        b_list.append(b)
    a_all = torch.cat(a_list, dim=0)  # [E r, in]
    b_all = torch.stack(b_list, dim=0).permute(1, 2, 0).reshape(b0.shape[0], r * n)  # [out, r, E] -> [out, r E]
    return a_all.contiguous(), b_all.contiguous()


def adapter_config(peft: PeftConfig, target_modules: list[str], target_parameters: list[str],
                   base_model_name_or_path: str | None) -> dict:
    """``adapter_config.json`` as peft's ``LoraConfig`` reads it."""
    dropout = 0.0 if target_parameters else float(peft.dropout)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": peft.rank, "lora_alpha": peft.alpha, "lora_dropout": dropout,
        "target_modules": target_modules or None, "target_parameters": target_parameters or None,
        "exclude_modules": None, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


@torch.no_grad()
def export_peft_adapter(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], peft: PeftConfig,
                        cfg: ModelConfig, out: str | Path, *, base_model_name_or_path: str | None = None,
                        like: str | Path | None = None, dtype: torch.dtype | None = None,
                        prefix: str = MODULE_PREFIX) -> Path:
    """Write LoRA adapters as a Hugging Face PEFT folder (``adapter_config.json``,
    ``adapter_model.safetensors``) for transformers' glm5_next; returns ``out``.

    ``tensors``: every adapter of the model, whole (all tensor-parallel ranks joined), named as a
    one-process model's parameters (``layers.1.self_attention.q_proj.lora_a``, routed experts by
    their global index), e.g. ``checkpoint.sharded.full_model_tensors(reader, keep=lambda k:
    ".lora_" in k)`` or a model's ``named_parameters()``; a GLU ``lora_b`` as stored ([2, F, r])
    or flattened ([2 F, r]). ``peft``: the run's ``PeftConfig`` (rank, alpha, dropout, targets);
    ``cfg``: the model's config. ``like``: the base glm5_next folder, when at hand: every
    adapter's shape is checked against its weight there (else against the sizes the config fixes:
    the MLPs' and experts'; the rank always). ``base_model_name_or_path``: recorded in the config
    for ``AutoPeftModel`` (default: ``like``). ``dtype``: the stored tensors' (default: their
    own). ``prefix``: where the text model's modules sit in the model peft wraps (transformers'
    ``Glm5NextForConditionalGeneration``: ``model.language_model.``; ``""`` for a bare
    ``Glm5NextTextModel``).

    Written to ``<out>.partial`` and renamed when complete; ``out`` must not exist or be empty.
    A missing or wrongly shaped adapter tensor is a one-line ``GenomeLMError`` naming it, and so
    is a run that trained base tensors whole (``peft.train``): the adapters alone are not its model."""
    from safetensors.torch import save_file

    if peft.train:
        raise GenomeLMError(f"peft.train {peft.train} trained base tensors whole, which an adapter folder does not "
                            "carry: export the merged model instead")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GenomeLMError(f"{out}: exists and is not empty; write the adapters into a new folder")
    state, modules, parameters = peft_adapter_tensors(tensors, peft, cfg, prefix=prefix, like=like)
    state = {k: (t.to(dtype) if dtype is not None else t).detach().cpu().contiguous().clone()
             for k, t in sorted(state.items())}
    if base_model_name_or_path is None and like is not None:
        base_model_name_or_path = str(like)
    config = adapter_config(peft, modules, parameters, base_model_name_or_path)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(state, str(partial / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    _honour_umask(partial / ADAPTER_WEIGHTS)
    (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(partial, out)
    return out
