"""The typed run configuration: one section per concern, every field documented, unknown keys and
wrong types rejected.

A run is described by a YAML file in ``configs/`` (``genome-lm finetune --config demo-cpu`` or a
path) plus ``--set section.field=value`` overrides. ``load_config`` validates it (strictly: the
string ``"true,"`` is not a bool, an unknown key is an error naming the file, the key and the valid
keys closest to it) and returns a frozen ``RunConfig``; ``RunConfig.resolved()`` is what gets logged
with the run.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from genome_lm.errors import GenomeLMError
from genome_lm.weights import resolve

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # packaged; ./configs links here


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-5`` (no dot) as a string; learning rates are written that way."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(exc: yaml.YAMLError) -> tuple[tuple[int, int] | None, str]:
    """((line, column) 1-based as editors count, or None) and the problem in words, with what the
    parser was inside when that started (an unclosed bracket is found only at the end)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return None, str(exc).splitlines()[0]
    at = (exc.problem_mark.line + 1, exc.problem_mark.column + 1)
    problem = exc.problem or str(exc).splitlines()[0]
    started = (exc.context_mark.line + 1, exc.context_mark.column + 1) if exc.context_mark else at
    if exc.context and started != at:
        problem += f" ({exc.context} at {started[0]}:{started[1]})"
    return at, problem


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MixSource(Section):
    dataset: str = Field(description="A folder written by `genome-lm prepare`.")
    split: str = Field("train", description="Its split to mix in.")
    fraction: float = Field(gt=0, lt=1, description="The share of the training sequences it gives.")


class DataConfig(Section):
    dataset: str = Field("data/demo/dataset", description="A folder written by `genome-lm prepare`.")
    train_split: str = Field("train", description="Split to train on.")
    eval_split: str = Field("eval", description="Split to evaluate on.")
    seq_len: int = Field(32768, gt=0, description="Tokens per training sequence (windows are cropped to it).")
    softmask_weight: float = Field(0.1, ge=0, le=1, description="Loss weight of soft-masked (repeat) positions.")
    reverse_complement: float = Field(0.0, ge=0, le=1, description="Probability of reverse-complementing a sequence.")
    max_n_fraction: float = Field(0.5, ge=0, le=1, description="Skip windows with more N than this fraction.")
    seq_len_warmup: list[tuple[int, int]] = Field(
        default_factory=list, description="[[step, seq_len], ...]: train at seq_len from that step on (e.g. 32k -> "
                                          "512k).")
    mix: list[MixSource] = Field(
        default_factory=list, description="Other prepared splits mixed into training, each a fraction of the "
                                          "sequences, e.g. [{dataset: data/drill, fraction: 0.2}] (the copy drill "
                                          "beside real DNA). The Markov baseline and eval read the main dataset only.")

    @model_validator(mode="after")
    def _mix(self):
        if sum(m.fraction for m in self.mix) >= 1:
            raise ValueError("data.mix: the fractions must add up to less than 1 (the rest is data.dataset)")
        return self


class ModelSection(Section):
    preset: str = Field("tiny", description="glm-5.3-flash, glm-5.3-flash-4layer, tiny or tiny-long (tiny initialised "
                                            "for the long-context recipe).")
    checkpoint: str | None = Field(
        None, description="Weights to start from: a Hugging Face glm5_next folder, a genome-lm training checkpoint "
                          "folder (with meta.json; the same model preset and parallel layout, or export it first) or "
                          "a training run folder (its checkpoints/latest); weights only, the run starts at step 0. "
                          "builtin:<name> = weights shipped with genome-lm (builtin:tiny-long, the CPU long-context "
                          "recipe's model; checked against their recorded SHA-256 and replaced by their folder). "
                          "None = random initialisation.")
    dtype: Literal["fp32", "bf16"] = "fp32"
    kernel_backend: Literal["auto", "torch", "triton", "triton-fp32", "fla", "reference"] = Field(
        "auto", description="KDA/DSA kernels: auto = triton on a GPU, torch on a CPU; triton = tensor-core Triton "
                            "kernels (bf16 products, fp32 state); triton-fp32 = the same in fp32 (parity checks); "
                            "fla = fla-core's chunk_kda for KDA (GPU, the gpu extra); reference = token loops.")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = Field(
        "auto", description="megatron-core spec provider; auto = Transformer Engine when installed and on GPU.")
    compile: bool = Field(
        False, description="Run the mHC Sinkhorn normalisation through torch.compile (inductor): the same results; "
                           "on 2 CPU cores a tiny-model step of 8 x 256 tokens took 0.22 s instead of 0.26 (no gain "
                           "measured at 8k tokens, where attention dominates), after about 30 s of compiling the "
                           "first time (cached on disk). Worth it for many short steps (the long-context recipe's "
                           "first stage). On a CPU it needs a C++ compiler; without one the run goes on uncompiled, "
                           "with a warning.")

    @field_validator("checkpoint")
    @classmethod
    def _shipped(cls, value: str | None) -> str | None:
        try:
            return resolve(value)
        except GenomeLMError as exc:
            raise ValueError(str(exc)) from None


class ParallelConfig(Section):
    tp: int = Field(1, ge=1, description="Tensor parallel size.")
    cp: int = Field(1, ge=1, description="Context parallel size (sequence split in zigzag order).")
    ep: int = Field(1, ge=1, description="Expert parallel size.")
    etp: int = Field(1, ge=1, description="Expert tensor parallel size.")
    pp: int = Field(1, ge=1, description="Pipeline parallel size: stages of consecutive layers, megatron-core's "
                                         "split, trained with a 1F1B schedule over micro-batches.")
    sequence_parallel: bool = Field(False, description="Split the residual streams (mHC, norms, MoE input) over the "
                                                      "tensor-parallel ranks: 1/tp of their activation memory; the "
                                                      "attention and dense MLP still see the whole sequence. No effect "
                                                      "without tensor parallel.")
    split_dsa_selection: bool = Field(True, description="Share the DSA indexer's selection and its loss out over the "
                                                        "tensor x context parallel group (each rank its blocks of "
                                                        "queries, the selections all-gathered as int32 pools) instead "
                                                        "of every rank of the group doing the whole sequence, as the "
                                                        "published run did, and gather the indexer's per-token inputs "
                                                        "over context parallel instead of the hidden state: the same "
                                                        "selections, losses and gradients, 1/(tp x cp) of the "
                                                        "selection's work, a quarter of the DSA layers' CP traffic.")
    overlap_grad_reduce: bool = Field(False, description="megatron-core DDP's overlap: each gradient bucket is reduced "
                                                         "over data parallel (reduce-scattered with the distributed "
                                                         "optimizer) as soon as the last micro-batch's backward has "
                                                         "filled it, while backward goes on; the other micro-batches "
                                                         "accumulate without communicating. The same gradients; "
                                                         "the reduction hides under backward instead of following it.")
    moe_shared_expert_overlap: bool = Field(False, description="megatron-core's overlap of the MoE shared expert with "
                                                               "the "
                                                               "routed tokens' all-to-all dispatch and combine (CUDA "
                                                               "streams: GPU backend and all-to-all dispatcher only).")
    gpus: int | None = Field(None, gt=0, description="GPUs (ranks) the run is laid out for: `genome-lm plan` plans "
                                                     "this many unless given --gpus, and `finetune` refuses another "
                                                     "number of ranks. None = not stated: the planner takes one "
                                                     "micro-batch per data-parallel rank (tp x cp x pp x global batch "
                                                     "/ micro batch), the trainer the ranks it is started on.")


class MemoryConfig(Section):
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_modules: list[Literal["attention", "mlp", "moe"]] = Field(
        default_factory=lambda: ["attention"], description="Modules recomputed when recompute = selective.")
    recompute_nested: bool = Field(False, description="With recompute = full, also recompute the attention and MLP/MoE "
                                                      "blocks inside each layer, so that a layer's backward holds one "
                                                      "block's activations at a time (lower peak, one more forward of "
                                                      "each block).")
    offload_activations: bool = Field(False, description="Keep saved activations in host memory between forward and "
                                                         "backward.")
    offload_pinned: bool = Field(True, description="Pinned host memory for offload (faster copies, rounded to powers "
                                                   "of two).")
    optimizer_offload: bool = Field(False, description="Keep optimizer state in host memory (megatron-core's CPU "
                                                       "offload).")
    moe_chunks: int = Field(1, ge=1, description="Pass the tokens through each MoE layer in this many chunks (the "
                                                 "published run used 64 at 512k).")
    moe_chunk_recompute: bool = Field(False, description="Checkpoint each MoE chunk on its own (needs moe_chunks > 1): "
                                                         "the MoE's backward holds one chunk's activations at a time, "
                                                         "for one more forward of the experts.")
    loss_chunk: int | None = Field(None, gt=0, description="Positions per block of the output layer and the loss, "
                                                          "each block's logits recomputed in backward (None = all at "
                                                          "once; the logits of a large vocabulary dominate long "
                                                          "windows).")
    dsa_query_chunk: int | None = Field(None, gt=0, description="Queries per chunk through each DSA layer "
                                                               "(None = all; the published run used 65536).")
    host_heap: Literal["auto", "keep", "return"] = Field(
        "auto", description="CPU runs: keep freed tensors in the heap for reuse (faster, up to twice the step's "
                            "memory resident), or return blocks above 4 MiB to the system when freed; auto: "
                            "`genome-lm finetune` keeps them where twice the plan's peak fits a rank's share "
                            "of the machine (engine.allocator).")
    dsa_keep_selection: bool = Field(True, description="Under recompute, keep each DSA layer's token selection "
                                                       "(4 bytes per position and selected pool) so that the "
                                                       "recomputed forward does not run the O(T^2) indexer again.")

    @model_validator(mode="after")
    def _moe_chunks(self):
        if self.moe_chunk_recompute and self.moe_chunks < 2:
            raise ValueError("moe_chunk_recompute needs moe_chunks > 1 (it checkpoints each MoE chunk)")
        return self


class TrainConfig(Section):
    steps: int = Field(80, gt=0)
    global_batch_size: int = Field(1, gt=0, description="Sequences per optimizer step, over all data-parallel ranks.")
    micro_batch_size: int = Field(1, gt=0)
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = Field(1.0, ge=0)
    lr_scale: dict[str, float] = Field(
        default_factory=dict, description="Learning-rate multipliers by parameter name: shell-style patterns, in "
                                          "order, the first that matches wins, e.g. {'*.indexer.*': 0, "
                                          "'*.self_attention.*': 0.3} freezes the DSA indexers and trains the "
                                          "attention at 0.3x the schedule (0 freezes). CPU optimizer only.")
    seed: int = 1234
    moe_aux_loss_coeff: float = Field(0.0, ge=0, description="Weight of the MoE auxiliary load-balancing loss (0 = "
                                                             "none: the routers' expert bias alone balances the "
                                                             "load; DeepSeek-V3 used 1e-4). Logged as moe_aux_loss.")
    moe_aux_loss: Literal["seq_aux_loss", "aux_loss"] = Field(
        "seq_aux_loss", description="Balance each sequence (seq_aux_loss, as DeepSeek-V3) or each micro-batch "
                                    "(aux_loss).")
    indexer_loss: Literal["off", "dense", "sparse"] = Field("sparse",
                                                            description="DSA indexer loss mode after warm-up.")
    indexer_dense_steps: int = Field(0, ge=0, description="Steps of dense indexer warm-up before `indexer_loss`.")
    indexer_loss_coeff: float = Field(1.0, ge=0)
    nonfinite: Literal["skip", "stop"] = Field("skip", description="On a non-finite loss: skip the step (and stop "
                                                                   "after 3 in "
                                                                   "a row) or stop at once.")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end and on a signal).")
    out_dir: str = Field("runs/default", description="Checkpoints, logs and the resolved config go here.")

    @model_validator(mode="after")
    def _batches(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        if any(scale < 0 for scale in self.lr_scale.values()):
            raise ValueError("lr_scale multipliers must be 0 (frozen) or more")
        return self


class TrackingConfig(Section):
    uri: str | None = Field(None, description="MLflow tracking URI; None = a local SQLite store in the run folder.")
    experiment: str = "genome-lm"
    run_name: str | None = None


LORA_TARGETS = ("*.self_attention.[qkvo]_proj", "*.self_attention.q_b_proj", "*.linear_fc1", "*.linear_fc2")


class PeftConfig(Section):
    """Parameter-efficient fine-tuning: the base model frozen, small adapters trained
    (``genome_lm.model.peft``; docs/training.md)."""

    method: Literal["none", "lora"] = Field(
        "none", description="none = full fine-tuning; lora = low-rank adapters on the frozen base (y = W x + "
                            "alpha / rank * B A x, B starting at zero): gradients and optimizer state only for the "
                            "adapters and the tensors `train` names.")
    rank: int = Field(8, ge=1, description="The adapters' rank r.")
    alpha: float = Field(16.0, gt=0, description="The adapters' scale is alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on an adapter's input while training (each rank "
                                                        "draws its own mask).")
    targets: list[str] = Field(
        list(LORA_TARGETS), min_length=1,
        description="Module names that get an adapter, as shell patterns over the names in the whole model (layers "
                    "numbered from 0 over every pipeline stage): the default takes the KDA and MLA query, key, value "
                    "and output projections and every MLP's fc1 and fc2 (dense, shared and routed experts); e.g. "
                    "'*.indexer.wq_b' adds the DSA indexer's. A pattern that matches nothing is an error.")
    train: list[str] = Field(
        [], description="Parameters trained whole beside the adapters, as shell patterns over parameter names "
                        "(e.g. '*.router.weight', 'output_layer.weight'); the rest of the base stays frozen, and "
                        "so do the routers' expert biases unless a router weight is trained.")


class RunConfig(Section):
    _source: str | None = PrivateAttr(None)  # the file it was read from (load_config), for names
    data: DataConfig = DataConfig()
    model: ModelSection = ModelSection()
    parallel: ParallelConfig = ParallelConfig()
    memory: MemoryConfig = MemoryConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()
    peft: PeftConfig = PeftConfig()

    @model_validator(mode="after")
    def _moe_aux_loss(self):
        if self.train.moe_aux_loss_coeff > 0 and self.memory.moe_chunks > 1:
            raise ValueError("train.moe_aux_loss_coeff > 0 needs memory.moe_chunks = 1 (chunked, each chunk of a "
                             "sequence would be balanced on its own: not the sequence's balance loss)")
        return self

    # here rather than on ParallelConfig: a section's error carries the whole section as its input
    @model_validator(mode="after")
    def _gpus(self):
        p = self.parallel
        if p.gpus is not None:  # the sizes engine.parallel.ParallelSizes.check asks of the world size
            for sizes, product in (("tp x cp x pp", p.tp * p.cp * p.pp), ("ep x etp x pp", p.ep * p.etp * p.pp)):
                if p.gpus % product:
                    raise ValueError(f"parallel.gpus = {p.gpus} is not a multiple of {sizes} = {product}")
        return self

    def resolved(self) -> dict:
        return self.model_dump(mode="json")

    @property
    def source(self) -> str | None:
        """The YAML file the config was read from (None: built in code or from defaults)."""
        return self._source

    def __eq__(self, other) -> bool:  # the settings, not where they were read from
        return isinstance(other, RunConfig) and self.model_dump() == other.model_dump()

    __hash__ = None


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise GenomeLMError(f"--set {dotted}: {key} is not a section")
    tree[leaf] = value


def find_config(name_or_path: str) -> Path:
    """A path, or the name of a file in configs/ (``demo-cpu`` -> configs/demo-cpu.yaml)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = CONFIG_DIR / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise GenomeLMError(f"{name_or_path}: no such config file or shipped config (shipped: {', '.join(names)})")


def load_config(name_or_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read, merge ``section.field=value`` overrides (values parsed as YAML), validate."""
    source = "defaults"
    tree: dict = {}
    if name_or_path is not None:
        path = find_config(name_or_path)
        source = str(path)
        try:
            tree = _yaml(path.read_text()) or {}
        except yaml.YAMLError as exc:
            at, problem = _yaml_problem(exc)
            where = f"{path}:{at[0]}:{at[1]}" if at else str(path)
            raise GenomeLMError(f"{where}: not valid YAML: {problem}") from None
        if not isinstance(tree, dict):
            raise GenomeLMError(f"{path}: the top level must be a mapping of sections")
    overridden = []
    for item in overrides:
        if "=" not in item:
            raise GenomeLMError(f"--set {item!r}: expected section.field=value")
        key, value = item.split("=", 1)
        overridden.append(key.strip())
        _set(tree, key.strip(), _set_value(item, value))
    try:
        cfg = RunConfig.model_validate(_lists_to_tuples(tree))
    except ValidationError as exc:
        errors = exc.errors()
        # an unknown key first: a misspelt field also makes the real one missing
        first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        first["msg"] = first["msg"].removeprefix("Value error, ")  # a validator's own sentence
        where = ".".join(str(p) for p in first["loc"])
        if not where:  # a rule across sections: its message names the fields
            raise GenomeLMError(f"{source}: {first['msg']}") from None
        unknown = first["type"] == "extra_forbidden"
        problem = _unknown_key(first["loc"]) if unknown else f"{first['msg']} (got {first.get('input')!r})"
        # --set's fault, not the file's; an unknown section or field may be the start of a --set key
        if any(where == k or where.startswith(k + ".") or (unknown and k.startswith(where + "."))
               for k in overridden):
            raise GenomeLMError(f"--set {where}: {problem}") from None
        raise GenomeLMError(f"{source}: {where}: {problem}") from None
    cfg._source = None if name_or_path is None else source
    return cfg


def _set_value(item: str, value: str):
    """A --set value parsed as YAML; the column counts in the value, all there is to point at."""
    try:
        return _yaml(value)
    except yaml.YAMLError as exc:
        at, problem = _yaml_problem(exc)
        if at is None:
            where = ""
        elif at[0] == 1:
            where = f" at column {at[1]} of the value"
        else:
            where = f" at line {at[0]}, column {at[1]} of the value"
        raise GenomeLMError(f"--set {item!r}: not valid YAML{where}: {problem}") from None


def _unknown_key(loc: tuple) -> str:
    """An unknown key in words, with the closest valid ones of its section (or the section's
    fields, or the sections, when none is close)."""
    model = _model_at(loc)
    if model is None:  # not reached through sections: nothing to suggest from
        return "no such field"
    fields = list(model.model_fields)
    parent = ".".join(str(p) for p in loc[:-1])
    # 0.7 rather than difflib's 0.6: "trian" is train, not also tracking
    close = difflib.get_close_matches(str(loc[-1]), fields, n=3, cutoff=0.7)
    what = "section" if model is RunConfig else "field"
    if close:
        return f"no such {what}; did you mean {' or '.join(f'{parent}.{c}' if parent else c for c in close)}?"
    if model is RunConfig:
        return f"no such section; the sections are {', '.join(fields)}"
    section = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))  # data.mix, not data.mix.0
    return f"no such field; the fields of {section} are {', '.join(fields)}"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model class that ``loc[-1]`` would be a field of, found by walking RunConfig's fields:
    a field that is a section, or a list of them (whose index is then skipped)."""
    model: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections: the model is already the item's
            continue
        field = model.model_fields.get(part)
        model = _section_in(field.annotation) if field is not None else None
        if model is None:
            return None
    return model


def _section_in(annotation) -> type[BaseModel] | None:
    """The model class in a field's type: itself, or inside list[...], X | None, ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if found := _section_in(arg):
            return found
    return None


def _lists_to_tuples(tree):
    """YAML has no tuples; strict validation of tuple fields wants them."""
    if isinstance(tree, dict):
        return {k: _lists_to_tuples(v) for k, v in tree.items()}
    if isinstance(tree, list) and tree and all(isinstance(x, list) for x in tree):
        return [tuple(x) for x in tree]
    return tree
