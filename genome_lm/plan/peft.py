"""LoRA in the planner (config section ``peft``, ``model.peft``): which projections get an
adapter, how many adapter parameters each rank holds, and what a frozen base changes in a
step's memory and FLOPs. From the model config alone (no torch).

    split = lora_parameters(cfg, run.peft)            # adapter elements by how they are split
    n = local_count(split, tp=8, ep=8, etp=1)         # ... held by one rank

``model.peft.apply_lora`` matches ``peft.targets`` against the names of the built model's modules
(layers numbered over the whole model) and ``peft.train`` against its parameter names. Those names
are generated here (``linears``, ``parameters``), with each projection's shape and split, and
tests/plan/test_peft.py checks them against the built tiny model, name for name.

An adapter on ``W`` (``out x in``) is ``lora_a [r, in]`` and ``lora_b [out, r]``, split as its
layer is: on a column-parallel layer ``lora_a`` whole on every tensor-parallel rank and
``lora_b`` split by rows; on a row-parallel one ``lora_a`` split by columns and ``lora_b`` whole;
a routed expert's the same over expert-tensor parallel, its experts divided over expert
parallel like theirs. Splits, as ``memory_model.parameter_split`` names them, plus one:

    replicated          whole on every rank of the tensor-parallel group
    tensor              split over tensor parallel
    expert              split over expert x expert-tensor parallel
    expert_replicated   routed experts' tensors whole on every expert-tensor-parallel rank,
                        divided over expert parallel (each rank its experts)

What a frozen base changes (docs/plan.md, "How PEFT is counted"): no gradient, master copy or
optimizer state for the base; a frozen projection's backward computes only its input's gradient
(1x its forward instead of 2x: no weight gradient), and it keeps nothing of its input for a
weight gradient; a frozen norm, mHC mixing map or gate keeps nothing for its weight's gradient
either. Each tensor a layer saved only for some weight's gradient is dropped unless that weight
is trained or carries an adapter (whose ``lora_a`` needs the same input). Each adapter keeps its
rank-r activation ``lora_a x`` for ``lora_b``'s gradient, and adds two thin products whose
time is the memory they move, not their FLOPs.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from genome_lm.config import PeftConfig
from genome_lm.errors import GenomeLMError
from genome_lm.model import flops
from genome_lm.model.config import DENSE, FULL, LINEAR, ModelConfig

from . import activations as act

NOT_TARGETS = ("kv_b_proj",)  # model.peft.NOT_TARGETS (that module imports torch; the test checks they agree)
SPLITS = ("replicated", "tensor", "expert", "expert_replicated")
INDEXER = "self_attention.indexer."


@dataclass(frozen=True)
class Linear:
    """One projection module of the model: its name in the whole model, its whole shape (all
    ranks together) and how its layer splits it."""

    name: str  # e.g. "layers.3.self_attention.q_b_proj"
    n_in: int
    n_out: int
    split: str  # "column", "row" (over tensor parallel; over expert-tensor parallel for routed experts) or "replicated"
    expert: bool = False  # a routed expert's
    shared: bool = False  # the MoE shared expert's (sequence-parallel under tensor parallel)

    @property
    def local(self) -> str:
        """The name inside its layer: "self_attention.q_b_proj" ("output_layer" for the head)."""
        return self.name.split(".", 2)[2] if self.name.startswith("layers.") else self.name


# ------------------------------------------------------------------------------------ names
def layer_linears(cfg: ModelConfig, i: int) -> list[Linear]:
    """The projection modules of layer ``i`` (routed experts numbered over the whole model)."""
    D, pre = cfg.hidden_size, f"layers.{i}."
    att = pre + "self_attention."
    if cfg.layer_types[i] == LINEAR:
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        W = H * K
        out = [Linear(att + "q_proj", D, W, "column"), Linear(att + "k_proj", D, W, "column"),
               Linear(att + "v_proj", D, W, "column"), Linear(att + "f_a_proj", D, K, "replicated"),
               Linear(att + "f_b_proj", K, W, "column"), Linear(att + "b_proj", D, H, "column"),
               Linear(att + "g_a_proj", D, K, "replicated"), Linear(att + "g_b_proj", K, W, "column"),
               Linear(att + "o_proj", W, D, "row")]
    else:
        H, rq, rkv = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        out = [Linear(att + "q_a_proj", D, rq, "replicated"),
               Linear(att + "q_b_proj", rq, H * cfg.qk_head_dim, "column"),
               Linear(att + "kv_a_proj_with_mqa", D, rkv, "replicated"),
               Linear(att + "kv_b_proj", rkv, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), "column"),
               Linear(att + "o_proj", H * cfg.v_head_dim, D, "row")]
        if cfg.indexer_types[i] == FULL:
            Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            ix = pre + INDEXER
            out += [Linear(ix + "wq_b", rq, Hi * Di, "replicated"), Linear(ix + "wk", D, Di, "replicated"),
                    Linear(ix + "weights_proj", D, Hi, "replicated")]
    mlp = pre + "mlp."
    if cfg.mlp_layer_types[i] == DENSE:
        I = cfg.intermediate_size
        return out + [Linear(mlp + "linear_fc1", D, 2 * I, "column"), Linear(mlp + "linear_fc2", I, D, "row")]
    Is, I = cfg.shared_expert_size, cfg.moe_intermediate_size
    for j in range(cfg.n_routed_experts):
        e = f"{mlp}experts.local_experts.{j}."
        out += [Linear(e + "linear_fc1", D, 2 * I, "column", expert=True),
                Linear(e + "linear_fc2", I, D, "row", expert=True)]
    return out + [Linear(mlp + "shared_experts.linear_fc1", D, 2 * Is, "column", shared=True),
                  Linear(mlp + "shared_experts.linear_fc2", Is, D, "row", shared=True)]


def head_linears(cfg: ModelConfig) -> list[Linear]:
    """The output layer (the embedding is a lookup, not a projection)."""
    return [Linear("output_layer", cfg.hidden_size, cfg.vocab_size, "column")]


def linears(cfg: ModelConfig, layers: Iterable[int] | None = None, last: bool = True) -> list[Linear]:
    """Every projection module of ``layers`` (all by default), and the output layer when ``last``."""
    out = [lin for i in (range(cfg.num_hidden_layers) if layers is None else layers) for lin in layer_linears(cfg, i)]
    return out + (head_linears(cfg) if last else [])


def other_modules(cfg: ModelConfig, layers: Iterable[int] | None = None, first: bool = True,
                  last: bool = True) -> list[tuple[str, str]]:
    """(name, class) of every module of a stage that is not a projection: the containers, norms,
    mHC, routers and the indexer (``apply_lora`` refuses a target among them)."""
    out = [("", "GLM5Model")] + ([("embedding", "VocabParallelEmbedding")] if first else [])
    out.append(("layers", "ModuleList"))
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        pre, kda = f"layers.{i}", cfg.layer_types[i] == LINEAR
        out += [(pre, "DecoderLayer"), (f"{pre}.attn_hc", "HyperConnection"), (f"{pre}.ffn_hc", "HyperConnection"),
                (f"{pre}.input_layernorm", "RMSNorm"), (f"{pre}.post_attention_layernorm", "RMSNorm"),
                (f"{pre}.self_attention", "KDAAttention" if kda else "DSAAttention")]
        if not kda:
            out += [(f"{pre}.self_attention.q_a_layernorm", "RMSNorm"),
                    (f"{pre}.self_attention.kv_a_layernorm", "RMSNorm")]
            if cfg.indexer_types[i] == FULL:
                out += [(f"{pre}.self_attention.indexer", "Indexer"), (f"{pre}.self_attention.indexer.k_norm",
                                                                       "LayerNorm")]
        if cfg.mlp_layer_types[i] == DENSE:
            out.append((f"{pre}.mlp", "MLP"))
        else:
            out += [(f"{pre}.mlp", "MoELayer"), (f"{pre}.mlp.router", "GLMRouter"),
                    (f"{pre}.mlp.experts", "SequentialMLP"), (f"{pre}.mlp.experts.local_experts", "ModuleList"),
                    (f"{pre}.mlp.shared_experts", "SharedExpertMLP")]
            out += [(f"{pre}.mlp.experts.local_experts.{j}", "MLP") for j in range(cfg.n_routed_experts)]
    return out + ([("final_norm", "RMSNorm")] if last else [])


def layer_parameters(cfg: ModelConfig, i: int) -> list[tuple[str, int, str]]:
    """(name in the whole model, elements, split) of each parameter of layer ``i``: the same
    tensors ``memory_model.parameter_split`` counts, but for the routers' expert biases (buffers)."""
    D, n, pre = cfg.hidden_size, cfg.hc_mult, f"layers.{i}."
    att = pre + "self_attention."
    out = []
    for hc in ("attn_hc", "ffn_hc"):
        out += [(f"{pre}{hc}.fn", (2 + n) * n * n * D, "replicated"), (f"{pre}{hc}.base", (2 + n) * n, "replicated"),
                (f"{pre}{hc}.scale", 3, "replicated")]
    out += [(pre + "input_layernorm.weight", D, "replicated"),
            (pre + "post_attention_layernorm.weight", D, "replicated")]
    if cfg.layer_types[i] == LINEAR:
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        W = H * K
        out += [(att + "conv_weight", 3 * W * cfg.linear_conv_kernel_dim, "tensor"), (att + "A_log", H, "tensor"),
                (att + "dt_bias", W, "tensor"), (att + "o_norm_weight", K, "replicated")]
    else:
        rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        out += [(att + "q_a_layernorm.weight", rq, "replicated"), (att + "kv_a_layernorm.weight", rkv, "replicated")]
        if cfg.indexer_types[i] == FULL:
            Di, ix = cfg.index_head_dim, pre + INDEXER
            out += [(ix + "index_kpool_compress_ape", cfg.index_kpool * Di, "replicated"),
                    (ix + "index_kpool_compress_gate", Di * D, "replicated"), (ix + "k_norm.weight", Di, "replicated"),
                    (ix + "k_norm.bias", Di, "replicated")]
    if cfg.mlp_layer_types[i] != DENSE:
        out.append((pre + "mlp.router.weight", cfg.n_routed_experts * D, "replicated"))
    for lin in layer_linears(cfg, i):
        split = "expert" if lin.expert else "replicated" if lin.split == "replicated" else "tensor"
        out.append((lin.name + ".weight", lin.n_in * lin.n_out, split))
    return out


def parameters(cfg: ModelConfig, layers: Iterable[int] | None = None, first: bool = True,
               last: bool = True) -> list[tuple[str, int, str]]:
    """(name, elements, split) of every parameter of a pipeline stage: ``layers`` (all by
    default), the embedding when ``first``, the final norm and output layer when ``last``."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out = [("embedding.weight", V * D, "tensor")] if first else []
    out += [p for i in (range(cfg.num_hidden_layers) if layers is None else layers) for p in layer_parameters(cfg, i)]
    if last:
        out.append(("final_norm.weight", D, "replicated"))
        if not (cfg.tie_word_embeddings and first):
            out.append(("output_layer.weight", V * D, "tensor"))
    return out


# ------------------------------------------------------------------------------- what LoRA takes
@dataclass(frozen=True)
class Trained:
    """What of one layer (or of the head: ``layer`` None) has a gradient under LoRA."""

    layer: int | None
    adapters: tuple[Linear, ...]  # the targeted projections (routed experts: one entry each)
    trained: tuple[tuple[str, int, str], ...]  # the parameters peft.train keeps trainable
    experts: int = 0  # routed experts of the layer
    rank: int = 8  # peft.rank
    dropout: bool = False  # peft.dropout > 0: each adapter takes a dropped copy of its input, not the input

    @functools.cached_property
    def adapter_split(self) -> dict[str, int]:
        """The adapters' elements by split (module docstring)."""
        total = dict.fromkeys(SPLITS, 0)
        for lin in self.adapters:
            for k, v in _adapter_split(lin, self.rank).items():
                total[k] += v
        return total

    @functools.cached_property
    def groups(self) -> tuple[tuple[Linear, int], ...]:
        """(adapted projection, how many): each routed expert projection once, with the number
        of experts whose projection it is; the others one by one."""
        counts: dict[Linear, int] = {}
        for lin in self.adapters:
            if lin.expert:  # the same shape and split in every expert: counted under expert 0's name
                head, _, tail = lin.name.partition(".local_experts.")
                lin = replace(lin, name=f"{head}.local_experts.0.{tail.split('.', 1)[1]}")
            counts[lin] = counts.get(lin, 0) + 1
        return tuple(counts.items())

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """Local names (inside the layer) of what needs its input kept: the adapted modules
        (without dropout) and the trained parameters, routed experts left out (``expert_share``)."""
        adapted = set() if self.dropout else {lin.local for lin in self.adapters if not lin.expert}
        return frozenset(adapted | self.trained_names)

    @functools.cached_property
    def trained_names(self) -> frozenset[str]:
        return frozenset(_local(name) for name, _, _ in self.trained if ".local_experts." not in name)

    def needs(self, *names: str) -> bool:
        """Whether any of these modules or parameters (local names) needs its input for a
        gradient: it has an adapter (``lora_a`` takes the module's input, unless dropout gives
        it a copy), or ``peft.train`` names its weight (``name.weight`` for a module)."""
        return any(n in self.names or f"{n}.weight" in self.names for n in names)

    def trains(self, name: str) -> bool:
        """Whether ``peft.train`` names this module's weight (or this parameter): the base
        computes its weight gradient."""
        return name in self.trained_names or f"{name}.weight" in self.trained_names

    def any_under(self, prefix: str) -> bool:
        """Whether anything under ``prefix`` has an adapter or a trained parameter."""
        return any(lin.local.startswith(prefix) for lin in self.adapters) or \
            any(n.startswith(prefix) for n in self.trained_names)

    def expert_share(self, projection: str, adapters: bool = True) -> float:
        """The share of the routed experts whose ``projection`` (linear_fc1 or linear_fc2) has a
        trained weight, or (``adapters``) an adapter or a trained weight."""
        if not self.experts:
            return 0.0
        chosen = {name.removesuffix(".weight") for name, _, _ in self.trained
                  if ".local_experts." in name and name.endswith(projection + ".weight")}
        if adapters and not self.dropout:
            chosen |= {lin.name for lin in self.adapters if lin.expert and lin.name.endswith(projection)}
        return len(chosen) / self.experts

    @functools.cached_property
    def key(self) -> tuple:
        """Equal for layers of one kind whose memory and FLOPs LoRA changes alike."""
        return (self.names, self.trained_names, *(self.expert_share(p, adapters) for p in ("linear_fc1", "linear_fc2")
                                                  for adapters in (True, False)))


def _local(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def _first_match(name: str, patterns) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def trained(cfg: ModelConfig, peft: PeftConfig) -> tuple[tuple[Trained, ...], Trained]:
    """(per layer, the head) what has a gradient under ``peft``, checked as ``apply_lora``
    checks it: a pattern that matches nothing, an adapter on kv_b_proj or of a rank above a
    projection's smaller side is an error."""
    return _trained(cfg, tuple(peft.targets), tuple(peft.train), peft.rank, peft.dropout > 0)


@functools.lru_cache(maxsize=64)
def _trained(cfg: ModelConfig, targets: tuple[str, ...], train: tuple[str, ...],
             rank: int, dropout: bool) -> tuple[tuple[Trained, ...], Trained]:
    hits = {p: 0 for p in targets}
    kept = {p: 0 for p in train}

    for name, cls in other_modules(cfg):
        if _first_match(name, targets) is not None:
            raise GenomeLMError(f"peft.targets: {name} is a {cls}, not a linear projection LoRA can adapt")

    def pick(mods: list[Linear], params: list[tuple[str, int, str]]):
        chosen = []
        for lin in mods:
            pattern = _first_match(lin.name, targets)
            if pattern is None:
                continue
            if lin.name.rsplit(".", 1)[-1] in NOT_TARGETS:
                raise GenomeLMError(f"peft.targets: {lin.name} is read as a raw weight by the absorbed attention "
                                    "path, which an adapter's hook does not see; leave it out")
            if rank > min(lin.n_in, lin.n_out):
                raise GenomeLMError(f"peft.rank {rank} is larger than {lin.name} ({lin.n_out} x {lin.n_in}): a rank "
                                    f"of at most {min(lin.n_in, lin.n_out)} adapts it")
            hits[pattern] += 1
            chosen.append(lin)
        kept_here = []
        for param in params:
            pattern = _first_match(param[0], train)
            if pattern is not None:
                kept[pattern] += 1
                kept_here.append(param)
        return tuple(chosen), tuple(kept_here)

    layers = []
    for i in range(cfg.num_hidden_layers):
        moe = cfg.mlp_layer_types[i] != DENSE
        layers.append(Trained(i, *pick(layer_linears(cfg, i), layer_parameters(cfg, i)),
                              experts=cfg.n_routed_experts if moe else 0, rank=rank, dropout=dropout))
    # the embedding, the final norm and the output layer
    head = Trained(None, *pick(head_linears(cfg), parameters(cfg, [])), rank=rank, dropout=dropout)
    for what, counts, kind in (("peft.targets", hits, "projection"), ("peft.train", kept, "parameter")):
        missing = [p for p, c in counts.items() if c == 0]
        if missing:
            raise GenomeLMError(f"{what} {', '.join(repr(m) for m in missing)} matches no {kind} of the model "
                                "(names such as layers.0.self_attention.q_proj, "
                                "layers.3.mlp.experts.local_experts.0.linear_fc1)")
    return tuple(layers), head


def inert_layers(cfg: ModelConfig, peft: PeftConfig, first_stage: int | None = None) -> int:
    """How many leading layers hold nothing for backward and run none: those before the first
    layer with an adapter or a trained parameter, on the first pipeline stage (``first_stage``
    layers, all by default), the embedding frozen. Nothing they compute depends on a tensor
    that needs a gradient. (A later stage receives streams that do: its layers all run
    backward, to send the gradient back.)"""
    per_layer, head = trained(cfg, peft)
    if any(name == "embedding.weight" for name, _, _ in head.trained):
        return 0
    first = next((lay.layer for lay in per_layer if lay.adapters or lay.trained), cfg.num_hidden_layers)
    return min(first, cfg.num_hidden_layers if first_stage is None else first_stage)


def lora(run) -> bool:
    """Whether ``run`` (a RunConfig) trains LoRA adapters on a frozen base."""
    return getattr(getattr(run, "peft", None), "method", "none") == "lora"


# ------------------------------------------------------------------------------- parameters
def _adapter_split(lin: Linear, r: int) -> dict[str, int]:
    a, b = r * lin.n_in, r * lin.n_out
    if lin.split == "replicated":
        return {"replicated": a + b}
    whole, split = ("expert_replicated", "expert") if lin.expert else ("replicated", "tensor")
    # column: lora_a whole, lora_b split by rows; row: lora_a split by columns, lora_b whole
    return {whole: a, split: b} if lin.split == "column" else {split: a, whole: b}


def lora_parameters(cfg: ModelConfig, peft: PeftConfig, layers: Iterable[int] | None = None, first: bool = True,
                    last: bool = True) -> dict[str, int]:
    """Adapter elements (``lora_a`` and ``lora_b``) of a pipeline stage (``layers``, all by
    default; the output layer's when ``last``) by split (module docstring). ``first`` only
    mirrors ``parameter_split``: the embedding takes no adapter."""
    per_layer, head = trained(cfg, peft)
    total = dict.fromkeys(SPLITS, 0)
    for lay in [per_layer[i] for i in (range(cfg.num_hidden_layers) if layers is None else layers)] + \
            ([head] if last else []):
        for k, v in lay.adapter_split.items():
            total[k] += v
    return total


def lora_by_kind(cfg: ModelConfig, peft: PeftConfig) -> dict[str, int]:
    """Adapter elements of the whole model by the kind of projection they adapt."""
    per_layer, head = trained(cfg, peft)
    out: dict[str, int] = {}
    for lay in (*per_layer, head):
        for lin in lay.adapters:
            if lin.expert:
                kind = "routed experts"
            elif lin.shared:
                kind = "shared experts"
            elif lay.layer is None:
                kind = "output layer"
            elif ".mlp." in lin.name:
                kind = "dense MLP"
            else:
                kind = "KDA attention" if cfg.layer_types[lay.layer] == LINEAR else "DSA attention"
            out[kind] = out.get(kind, 0) + sum(_adapter_split(lin, peft.rank).values())
    return out


def trainable_split(cfg: ModelConfig, peft: PeftConfig, layers: Iterable[int] | None = None, first: bool = True,
                    last: bool = True) -> dict[str, int]:
    """What has a gradient and optimizer state on a stage: its adapters and the parameters
    ``peft.train`` names, by split."""
    layers = list(range(cfg.num_hidden_layers) if layers is None else layers)
    total = lora_parameters(cfg, peft, layers, first, last)
    per_layer, head = trained(cfg, peft)
    for i in layers:
        for _, numel, split in per_layer[i].trained:
            total[split] += numel
    for name, numel, split in head.trained:  # the embedding on the first stage, the rest on the last
        if first if name == "embedding.weight" else last:
            total[split] += numel
    return total


def local_count(split: dict[str, float], tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[float, float]:
    """(dense, expert) elements one rank holds of ``split`` (``lora_parameters``, ``trainable_split``
    or ``parameter_split``): the dense ones sharded by the distributed optimizer over data x
    context parallel, the expert ones over expert-data parallel."""
    dense = split.get("replicated", 0) + split.get("tensor", 0) / tp
    return dense, split.get("expert", 0) / (ep * etp) + split.get("expert_replicated", 0) / ep


# ------------------------------------------------------------------------------- activations
def saved_change(cfg: ModelConfig, s: act.Shard, i: int, lay: Trained, peft: PeftConfig,
                 own_indexer: bool) -> tuple[float, float, float]:
    """(attention, MLP, mHC/norms) bytes per local token that layer ``i`` saves under LoRA minus
    what it saves trained whole (``activations.saved_*``): the tensors kept only for the gradient
    of a weight that is now frozen go, each adapter's rank-r activation comes."""
    a, D, n = s.a, cfg.hidden_size, cfg.hc_mult
    gone_att = gone_mlp = 0.0
    if cfg.layer_types[i] == LINEAR:
        h, K = cfg.linear_num_heads // s.tp, cfg.linear_head_dim
        W = h * K
        for needed, nbytes in (
                (lay.needs(*(f"self_attention.{p}" for p in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj",
                                                             "g_a_proj"))), D * a),  # x
                (lay.needs("self_attention.f_b_proj"), K * a), (lay.needs("self_attention.g_b_proj"), K * a),
                (lay.needs("self_attention.A_log"), W * act.F32),  # the decay logits times exp(A_log)
                (lay.needs("self_attention.o_norm_weight"), W * act.F32),  # the output norm's normed value
                (lay.needs("self_attention.o_proj"), W * a)):
            gone_att += 0.0 if needed else nbytes
    else:
        rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        indexer = own_indexer and lay.any_under(INDEXER)
        for needed, nbytes in (
                (lay.needs("self_attention.q_a_proj", "self_attention.kv_a_proj_with_mqa") or indexer, D * a),
                (lay.needs("self_attention.q_a_layernorm"), rq * a),
                (lay.needs("self_attention.kv_a_layernorm"), rkv * a),
                (lay.needs("self_attention.q_b_proj") or indexer, rq * a),  # q_resid, also the indexer's query input
                # the latent as kv_b_proj's input (the absorbed GPU path reads kv_b_proj raw: kept there)
                (lay.needs("self_attention.kv_b_proj") or s.gpu_kernels, rkv * a),
                # under CP the attention's output back in sequence order, o_proj's input
                (lay.needs("self_attention.o_proj") or s.cp == 1,
                 cfg.num_attention_heads // s.tp * cfg.v_head_dim * a)):
            gone_att += 0.0 if needed else nbytes
        if own_indexer and s.indexer_loss and not indexer:  # a frozen indexer's loss has no gradient
            gone_att += act.saved_dsa(cfg, s, True) - act.saved_dsa(cfg, s, False)
    if cfg.mlp_layer_types[i] == DENSE:
        I = cfg.intermediate_size / s.tp
        gone_mlp = (0.0 if lay.needs("mlp.linear_fc1") else D * a) + (0.0 if lay.needs("mlp.linear_fc2") else I * a)
    else:
        copies = act.expert_copies(cfg, s)
        I, Is = cfg.moe_intermediate_size / s.etp, cfg.shared_expert_size / s.tp
        # the routed copies' fc1 inputs and fc2 inputs; the shared expert's fc2 input (its fc1 input
        # is the MoE layer's input, which the layer keeps anyway)
        # the copies' fc1 inputs are views of one permuted tensor: kept whole while any expert needs its part
        fc1_kept = lay.expert_share("linear_fc1") > 0
        gone_mlp = copies * ((0.0 if fc1_kept else D) + (1 - lay.expert_share("linear_fc2")) * I) * a
        gone_mlp += 0.0 if lay.needs("mlp.shared_experts.linear_fc2") else Is * a
    gone_rest = 0.0
    for hc in ("attn_hc", "ffn_hc"):  # the mixing map's normed input, the mixing logits before the scale
        gone_rest += (0.0 if lay.needs(f"{hc}.fn") else n * D * act.F32) + \
            (0.0 if lay.needs(f"{hc}.scale") else (2 + n) * n * act.F32)
    for norm in ("input_layernorm", "post_attention_layernorm"):  # the normed value before the weight
        gone_rest += 0.0 if lay.needs(norm) else D * a
    gone_rest *= s.stream_tokens
    att, mlp = _adapter_saved(cfg, s, lay, peft)
    return att - gone_att, mlp - gone_mlp, -gone_rest


def _tokens(lin: Linear, cfg: ModelConfig, s: act.Shard) -> float:
    """Positions per local token at which ``lin`` runs its adapter's rank-r product (its
    ``lora_b`` input): routed experts per token copy, the shared expert's row adapter on the
    sequence-parallel slice, the DSA indexer's query projection over the whole sequence."""
    if lin.expert:
        return act.expert_copies(cfg, s)
    if lin.shared and lin.split == "row":
        return 1 / s.tp
    if lin.name.endswith("indexer.wq_b") or (INDEXER in lin.name and not s.gather_token_inputs):
        return s.cp
    return 1.0


def _in_width(lin: Linear, s: act.Shard) -> float:
    return lin.n_in / (s.etp if lin.expert else s.tp) if lin.split == "row" else lin.n_in


def _adapter_saved(cfg: ModelConfig, s: act.Shard, lay: Trained, peft: PeftConfig) -> tuple[float, float]:
    """(attention, MLP) bytes per local token of the adapters' saved tensors: ``lora_a x`` (r
    wide) for ``lora_b``'s gradient; with dropout also the dropped copy of the input (for
    ``lora_a``'s gradient) and what dropout keeps for its own backward (``_dropout_kept``)."""
    att = mlp = 0.0
    for lin in lay.adapters:
        per = peft.rank * s.a + (_in_width(lin, s) * (s.a + _dropout_kept(s)) if peft.dropout else 0.0)
        nbytes = per * _tokens(lin, cfg, s) / (cfg.n_routed_experts if lin.expert else 1)
        if ".mlp." in lin.name:
            mlp += nbytes
        else:
            att += nbytes
    return att, mlp


def _dropout_kept(s: act.Shard) -> float:
    """Bytes per input element dropout keeps for its backward: on a GPU the fused kernel's bool
    mask, on a CPU the scaled noise it multiplies by, in the activations' dtype."""
    return 1.0 if s.gpu_kernels else s.a


def head_change(cfg: ModelConfig, s: act.Shard, head: Trained, peft: PeftConfig) -> float:
    """Bytes per local token the loss head saves under LoRA minus trained whole: the final
    norm's normed value and the output layer's input go with their weights frozen."""
    gone = (0.0 if head.needs("final_norm") else cfg.hidden_size * s.a * s.stream_tokens) + \
        (0.0 if head.needs("output_layer") else cfg.hidden_size * s.a)
    adapter = peft.rank * s.a + (cfg.hidden_size * (s.a + _dropout_kept(s)) if peft.dropout else 0.0)
    return (adapter if head.adapters else 0.0) - gone


def indexer_frozen(cfg: ModelConfig, i: int, lay: Trained) -> bool:
    """Layer ``i`` has its own DSA indexer and nothing of it trains: its loss has no gradient."""
    return (cfg.layer_types[i] != LINEAR and cfg.indexer_types[i] == FULL and not lay.any_under(INDEXER))


# ------------------------------------------------------------------------------------ FLOPs
ATTENTION_PIECES = {
    "KDA projections": ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj", "o_proj"),
    "KDA low-rank projections": ("f_a_proj", "g_a_proj"),
    "MLA projections": ("q_b_proj", "kv_b_proj", "o_proj"),
    "MLA low-rank projections": ("q_a_proj", "kv_a_proj_with_mqa"),
    "DSA indexer projections": ("indexer.wq_b", "indexer.wk", "indexer.weights_proj",
                                "indexer.index_kpool_compress_gate"),
}


@functools.lru_cache(maxsize=1024)
def _shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each weight ``model.flops`` counts in layer ``i``, by local name."""
    shapes = {lin.local: (lin.n_in, lin.n_out) for lin in layer_linears(cfg, i) if not lin.expert}
    D = cfg.hidden_size
    if cfg.layer_types[i] != LINEAR and cfg.indexer_types[i] == FULL:
        shapes["self_attention.indexer.index_kpool_compress_gate"] = (D, cfg.index_head_dim)
    if cfg.mlp_layer_types[i] != DENSE:
        shapes["mlp.router"] = (D, cfg.n_routed_experts)
    return shapes


def _backward(cfg: ModelConfig, i: int, lay: Trained, name: str, T: int, batch: int,
              indexer_loss: str, gpu: bool, old: float) -> float:
    """The backward FLOPs of piece ``name`` of layer ``i`` (``model.flops.layer_work``) under
    LoRA, given ``old``, its backward trained whole: a frozen weight's product computes its
    input's gradient only (a detached input's, the indexer's, nothing), a trained weight's both."""
    n = batch * T
    shapes = _shapes(cfg, i)
    if name in ATTENTION_PIECES:
        indexer = name == "DSA indexer projections"
        if indexer and indexer_loss == "off":
            return 0.0
        total = 0.0
        for local in ATTENTION_PIECES[name]:
            key = f"self_attention.{local}"
            fwd = 2.0 * n * shapes[key][0] * shapes[key][1]
            total += fwd * ((1 if lay.trains(key) else 0) + (0 if indexer else 1))
        return total
    if name == "dense MLP":
        return sum(2.0 * n * shapes[k][0] * shapes[k][1] * (2 if lay.trains(k) else 1)
                   for k in ("mlp.linear_fc1", "mlp.linear_fc2"))
    if name == "MoE router":
        return 2.0 * n * shapes["mlp.router"][0] * shapes["mlp.router"][1] * (2 if lay.trains("mlp.router") else 1)
    if name == "MoE shared expert":
        return sum(2.0 * n * shapes[k][0] * shapes[k][1] * (2 if lay.trains(k) else 1)
                   for k in ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"))
    if name == "MoE routed experts":  # old = 2 x forward; now the input gradient, weight gradients where trained
        # fc1 ([gate; up]) has twice fc2's FLOPs
        share = (2 * lay.expert_share("linear_fc1", False) + lay.expert_share("linear_fc2", False)) / 3
        return old / 2 * (1 + share)
    if name == "mHC":
        nh, D = cfg.hc_mult, cfg.hidden_size
        projection = 2.0 * n * nh * D * (2 + nh) * nh  # one mHC's mixing map; old = 2 x forward
        return old - sum(projection for hc in ("attn_hc", "ffn_hc") if not lay.trains(f"{hc}.fn"))
    if name in ("DSA indexer loss target", "DSA indexer loss scores"):
        return 0.0 if indexer_frozen(cfg, i, lay) else old
    if name == "DSA sparse attention" and gpu and not lay.trains("self_attention.kv_b_proj"):
        # absorbed: no weight gradients of W_UK and W_UV (kv_b_proj's halves)
        H, L = cfg.num_attention_heads, cfg.kv_lora_rank
        return old - 2.0 * n * H * L * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return old


def _adapter_work(lin: Linear, n: float, r: int, layer: str, dropout: float, a: int) -> tuple[list, list]:
    """(FLOPs, bytes) of one adapter on ``n`` positions (routed experts: the copies that reach
    it), as ``model.flops.Work`` items by how they split (bytes in ``forward``/``backward``):
    the rank-r products (lora_a's input gradient none where the input is detached), and the
    memory its hook moves: reading x, writing and scaling ``lora_b h`` and adding it to the
    output (six output-wide passes), and in backward reading x and the output gradient twice
    each and adding x's gradient in."""
    detached = INDEXER in lin.name
    if lin.expert:
        a_split = b_split = "experts"
    elif lin.shared:
        a_split = b_split = "heads"
    elif INDEXER in lin.name:
        a_split = b_split = "whole"
    elif lin.split == "replicated":
        a_split = b_split = "tokens"
    elif lin.split == "column":  # lora_a whole on each tensor-parallel rank, lora_b split
        a_split, b_split = "tokens", "heads"
    else:
        a_split, b_split = "heads", "tokens"
    fa, fb = 2.0 * n * r * lin.n_in, 2.0 * n * r * lin.n_out
    ops = [flops.Work("LoRA adapters", layer, fa, fa * (1 if detached else 2), split=a_split),
           flops.Work("LoRA adapters", layer, fb, 2 * fb, split=b_split)]
    x_in = n * lin.n_in * a * (3 if dropout else 1)
    x_back = n * lin.n_in * a * (6 if dropout else 4)
    moved = [flops.Work("LoRA adapters (memory)", layer, x_in, x_back, split=a_split),
             flops.Work("LoRA adapters (memory)", layer, 6.0 * n * lin.n_out * a, 4.0 * n * lin.n_out * a,
                        split=b_split)]
    return ops, moved


def _merge_items(items: list) -> list:
    merged: dict[tuple, flops.Work] = {}
    for w in items:
        key = (w.name, w.layer, w.split, w.kind)
        if key in merged:
            m = merged[key]
            merged[key] = replace(m, forward=m.forward + w.count * w.forward,
                                  backward=m.backward + w.count * w.backward, replay=m.replay + w.count * w.replay)
        else:
            merged[key] = replace(w, forward=w.count * w.forward, backward=w.count * w.backward,
                                  replay=w.count * w.replay, count=1)
    return list(merged.values())


def lora_work(work: list, cfg: ModelConfig, run, *, T: int, batch: int, gpu: bool, layers: range | None = None,
              head: bool = True, a: int = 2, inert: int = 0) -> tuple[list, list]:
    """``model.flops.step_work``'s pieces of a stage (``layers``, the head when ``head``) under
    ``run``'s LoRA: each piece's backward as a frozen base computes it (``_backward``), none at
    all (nor a recompute) in the first ``inert`` layers (``inert_layers``), and the adapters'
    products added as "LoRA adapters" items (replayed as their layers are under recompute).
    Returns (the FLOP pieces, the adapters' memory traffic as pieces of bytes, ``a`` bytes an
    activation element)."""
    peft, mem = run.peft, run.memory
    per_layer, head_lay = trained(cfg, peft)
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    mode, n = run.train.indexer_loss, batch * T
    merge = 2.0 * batch * T * cfg.hc_mult**2 * cfg.hidden_size  # as step_work passes it to with_recompute
    old: dict[str, list[float]] = {}  # piece name -> [backward, replay] over the stage, trained whole
    for w in work:
        old.setdefault(w.name, [0.0, 0.0])
        old[w.name][0] += w.count * w.backward
        old[w.name][1] += w.count * w.replay
    new = {name: [0.0, 0.0] for name in old}
    kinds: dict[tuple, list] = {}  # layers alike: computed once, counted
    for i in layers:
        lay = per_layer[i]
        key = (cfg.layer_kind(i), lay.key, i < inert)
        if key not in kinds:
            moe = cfg.mlp_layer_types[i] != DENSE
            pieces = flops.with_recompute(flops.layer_work(cfg, i, T, batch, indexer_loss_mode=mode, gpu=gpu,
                                                           chunk=mem.dsa_query_chunk or flops.DSA_CHUNK),
                                          mem, moe, merge)
            if i < inert:  # nothing needs a gradient yet: no backward, nothing recomputed
                changed = {w.name: (0.0, 0.0) for w in pieces}
            else:
                changed = {w.name: (_backward(cfg, i, lay, w.name, T, batch, mode, gpu, w.backward), w.replay)
                           for w in pieces}
            ops, moved = [], []
            for lin, count in lay.groups:
                tag = ("dense MLP" if not moe else "MoE") if ".mlp." in lin.name else \
                    ("KDA" if cfg.layer_types[i] == LINEAR else "DSA")
                # a routed expert's adapters see the copies routed to the experts that have them
                tokens = n * cfg.num_experts_per_tok * count / cfg.n_routed_experts if lin.expert else n
                o, m = _adapter_work(lin, tokens, peft.rank, tag, peft.dropout, a)
                ops += o
                moved += m
            kinds[key] = [changed, _merge_items(flops.with_recompute(ops, mem, moe)),
                          _merge_items(flops.with_recompute(moved, mem, moe)), 0]
        kinds[key][3] += 1
    extra_ops, extra_bytes = [], []
    for changed, ops, moved, count in kinds.values():
        for name, (backward, replay) in changed.items():
            if name in new:
                new[name][0] += count * backward
                new[name][1] += count * replay
        extra_ops += [replace(w, count=count) for w in ops]
        extra_bytes += [replace(w, count=count) for w in moved]
    if head and "output layer" in old:
        # frozen: the logits' input gradient only; its replay (the loss blocks' logits) as it was
        new["output layer"] = [old["output layer"][0] * (1.0 if head_lay.trains("output_layer") else 0.5),
                               old["output layer"][1]]
        chunked = mem.loss_chunk is not None and mem.loss_chunk < T  # the logits recomputed per loss block
        for lin in head_lay.adapters:
            ops, moved = _adapter_work(lin, n, peft.rank, "head", peft.dropout, a)
            extra_ops += [replace(w, replay=w.forward if chunked else 0.0) for w in ops]
            extra_bytes += [replace(w, replay=w.forward if chunked else 0.0) for w in moved]
    out = []
    for w in work:
        (old_b, old_r), (new_b, new_r) = old[w.name], new[w.name]
        out.append(replace(w, backward=w.backward * new_b / old_b if old_b else 0.0,
                           replay=w.replay * new_r / old_r if old_r else 0.0))
    return out + _merge_items(extra_ops), _merge_items(extra_bytes)


__all__ = ["Linear", "Trained", "head_change", "indexer_frozen", "inert_layers", "layer_linears", "linears",
           "local_count", "lora", "other_modules",
           "lora_by_kind", "lora_parameters", "lora_work", "parameters", "saved_change", "trainable_split", "trained"]
