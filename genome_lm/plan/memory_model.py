"""Memory of one training step per GPU (and per node of host memory), from a ``RunConfig``.

    plan = estimate(run_config, Hardware(...))

The model sizes come from the config the trainer builds (``model.preset`` or the checkpoint's
config.json, exactly as ``checkpoint.build`` reads them); the bytes per token of each piece
from ``plan.activations``. The step's peak is the largest of

    forward end / loss:   static + sum over layers of what they keep + the loss head
    backward of layer i:  static + what layers 0..i keep + layer i's saved tensors (recomputed
                          under recompute, brought back under offload) + its backward buffers,
                          in two phases: the MLP's backward (everything the layer saved alive)
                          and the attention's (the MLP half's saved tensors freed by then)

where a layer keeps everything it saves (no recompute), its input streams (full recompute) or
everything but the recomputed modules (selective); with offload on a GPU what layers keep goes
to host memory instead. Static memory: parameters, the fp32 gradient buffer of megatron-core
DDP, and the optimizer (fp32 master copy when parameters are bf16, Adam's two moments), sharded
over data parallel by the distributed optimizer on GPU and moved to host by optimizer offload.
Under LoRA (``peft.method: lora``) the base is frozen: gradients and optimizer state are the
adapters' and ``peft.train``'s only, and each layer saves what a frozen base saves
(``plan.peft``).

Under pipeline parallel each stage is planned with its own layers (the embedding on the first,
the loss head on the last), and its activations grow by what its layers keep for each further
micro-batch in flight under 1F1B (the first stage holds min(pp, micro-batches per rank) of them,
the last one); the plan is the busiest stage's.

Not modelled: the memory allocator's fragmentation and the CUDA context and communication
buffers (``Hardware.headroom`` leaves room for them); the streams in transit between pipeline
stages (one micro-batch's [S, B, N, D] in each direction; a sent output is freed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from genome_lm.config import PeftConfig, RunConfig
from genome_lm.engine.allocator import heap_fits
from genome_lm.errors import GenomeLMError
from genome_lm.model.config import DENSE, FULL, LINEAR, ModelConfig
from genome_lm.model.model import pipeline_stages  # noqa: F401  (re-exported for the planner's callers)
from genome_lm.model.presets import model_config  # noqa: F401

from . import activations as act
from .peft import head_change as lora_head_change
from .peft import indexer_frozen as lora_indexer_frozen
from .peft import inert_layers as lora_inert_layers
from .peft import local_count, lora, lora_parameters, trainable_split
from .peft import saved_change as lora_saved_change
from .peft import trained as lora_trained

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """Where the run goes. ``device`` "gpu" (bf16 kernels, Triton) or "cpu" (the torch path,
    where offload moves nothing: host memory is the device's)."""

    gpu_name: str = "B200"
    gpu_bytes: float = 180e9
    gpus: int | None = None  # None: the config's parallel.gpus, else one micro-batch per data-parallel rank
    gpus_per_node: int = 8
    device: str = "gpu"
    moe_imbalance: float = 4.0
    headroom: float = 0.05  # of GPU memory kept for the CUDA context, NCCL buffers, fragmentation

    @property
    def usable(self) -> float:
        """GPU bytes a plan may fill: all of it but the headroom."""
        return self.gpu_bytes * (1 - self.headroom)


@dataclass
class Item:
    name: str
    bytes: float
    note: str = ""


@dataclass
class Saving:
    """What one memory switch does, against the same run without it: the bytes it saves on the
    GPU's peak and of host memory per GPU, each negative where the switch costs them instead."""

    switch: str  # as the run sets it: "recompute full"
    against: str  # what the run without it has instead: "none"
    gpu: float
    host: float


@dataclass
class Plan:
    """Per-GPU device memory items, per-GPU host items, and the step's peak."""

    run: RunConfig
    model: ModelConfig
    hw: Hardware
    gpus: int
    tokens: int  # tokens of this rank's part of each micro-batch
    params_local: float
    device: list[Item] = field(default_factory=list)  # static + activation peak parts
    activations: list[Item] = field(default_factory=list)  # per layer type, saved (before offload)
    savings: list[Saving] = field(default_factory=list)  # what the memory switches save or cost
    host: list[Item] = field(default_factory=list)  # per GPU
    peak_where: str = ""
    offloaded_per_token: float = 0.0
    stage: int = 0  # the pipeline stage this plan is for (the busiest one)
    stages: int = 1
    layers: range = range(0)
    in_flight: int = 1  # micro-batches whose activations the stage holds at once

    @property
    def peak(self) -> float:
        return sum(i.bytes for i in self.device)

    @property
    def host_per_gpu(self) -> float:
        return sum(i.bytes for i in self.host)

    @property
    def host_per_node(self) -> float:
        return self.host_per_gpu * min(self.gpus, self.hw.gpus_per_node)

    @property
    def usable(self) -> float:
        return self.hw.usable

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable


# --------------------------------------------------------------------------------- parameters
def parameter_split(cfg: ModelConfig, layers: range | None = None, first: bool = True,
                    last: bool = True) -> dict[str, int]:
    """Parameters by how they are sharded: "replicated" (every TP rank holds them: low-rank
    projections, norms, mHC, indexer, routers), "tensor" (split over TP: heads, MLPs, the shared
    expert, embedding and output layer), "expert" (split over EP x ETP). A pipeline stage holds
    ``layers``, the embedding when it is the ``first`` stage, the final norm and the output layer
    when it is the ``last`` (all of the model by default)."""
    D, n = cfg.hidden_size, cfg.hc_mult
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    W = H * K
    kda_tp = 3 * D * W + 3 * W * cfg.linear_conv_kernel_dim + 2 * K * W + H + W + D * H + W * D
    kda_rep = 2 * D * K + K
    Hq, rq, rkv = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    mla_tp = rq * Hq * cfg.qk_head_dim + rkv * Hq * (cfg.qk_nope_head_dim + cfg.v_head_dim) + Hq * cfg.v_head_dim * D
    mla_rep = D * rq + rq + D * rkv + rkv
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    indexer = rq * Hi * Di + D * Di + 2 * Di + D * Hi + cfg.index_kpool * Di + Di * D
    mhc = 2 * ((2 + n) * n * (n * D) + (2 + n) * n + 3)
    head = cfg.vocab_size * D
    tied = cfg.tie_word_embeddings and first and last
    out = {"replicated": D if last else 0, "tensor": head * (first + last - tied), "expert": 0}
    for i in (range(cfg.num_hidden_layers) if layers is None else layers):
        out["replicated"] += 2 * D + mhc
        if cfg.layer_types[i] == LINEAR:
            out["tensor"] += kda_tp
            out["replicated"] += kda_rep
        else:
            out["tensor"] += mla_tp
            out["replicated"] += mla_rep + (indexer if cfg.indexer_types[i] == FULL else 0)
        if cfg.mlp_layer_types[i] == DENSE:
            out["tensor"] += 3 * D * cfg.intermediate_size
        else:
            out["expert"] += cfg.n_routed_experts * 3 * D * cfg.moe_intermediate_size
            out["tensor"] += 3 * D * cfg.shared_expert_size
            out["replicated"] += cfg.n_routed_experts * (D + 1)  # router weight and expert bias
    return out


# ------------------------------------------------------------------------------------ layers
@dataclass(frozen=True)
class LayerBytes:
    """Bytes per local token of one decoder layer."""

    kind: str  # "KDA" or "DSA"
    mlp: str  # "dense" or "MoE"
    attention: float
    mlp_saved: float
    rest: float  # mHC, norms, merges
    input: float
    backward_streams: float  # stream gradients, alive through the layer's backward
    backward_attention: float  # the attention kernels' gradient buffers
    backward_mlp: float  # the MLP's or experts' gradient buffers
    backward_fixed: float  # bytes of fixed-size working blocks in the attention's backward
    forward_fixed: float  # ... in forward (and in a recompute of the layer)
    selection: float = 0.0  # the DSA selection's int32 pools, kept for a recompute (dsa_keep_selection)
    loss_fixed: float = 0.0  # bytes of the indexer loss's working blocks in its backward
    attention_kernel: float = 0.0  # per token: the sparse attention's saved tensors (freed before the loss's backward)
    replay_fixed: float = 0.0  # forward_fixed of a recompute that replays the kept selection

    @property
    def saved(self) -> float:
        return self.attention + self.mlp_saved + self.rest

    @property
    def backward(self) -> float:
        """The larger phase's backward buffers, per token."""
        return self.backward_streams + max(self.backward_attention, self.backward_mlp)

    @property
    def partial(self) -> float:
        """Saved by the time the attention block has run: the first mHC and norm, the attention."""
        return self.rest / 2 + self.attention


def layer_bytes(cfg: ModelConfig, s: act.Shard, seq_len: int = 0, batch: int = 1,
                peft: PeftConfig | None = None, inert: int = 0) -> list[LayerBytes]:
    """Per layer; ``seq_len`` (the whole sequence) sizes the DSA indexer's query blocks. With
    ``peft`` (method lora) as a frozen base with adapters saves (``plan.peft.saved_change``),
    its first ``inert`` layers nothing at all (``plan.peft.inert_layers``)."""
    layers = []
    rest = 2 * act.saved_hyper_connection(cfg, s) + 2 * act.saved_rmsnorm(cfg.hidden_size, s) * s.stream_tokens + \
        2 * act.saved_merge(cfg, s)
    adapted = peft is not None and peft.method == "lora"
    trained = lora_trained(cfg, peft)[0] if adapted else None
    kinds: dict[tuple, LayerBytes] = {}  # layers of one kind hold the same bytes: computed once
    for i in range(cfg.num_hidden_layers):
        kind = (cfg.layer_kind(i), trained[i].key, i < inert) if adapted else cfg.layer_kind(i)
        if kind in kinds:
            layers.append(kinds[kind])
            continue
        kda = cfg.layer_types[i] == LINEAR
        moe = cfg.mlp_layer_types[i] != DENSE
        attention = act.saved_kda(cfg, s) if kda else act.saved_dsa(cfg, s, cfg.indexer_types[i] == FULL)
        mlp = act.saved_moe(cfg, s) if moe else act.saved_dense_mlp(cfg, s)
        fixed, forward_fixed, selection, replay_fixed = act.backward_fixed(cfg, s, kda), 0.0, 0.0, 0.0
        loss_fixed = 0.0
        if not kda and cfg.indexer_types[i] == FULL:
            select_blocks, loss_forward, loss_fixed = act.indexer_blocks(cfg, s, seq_len, batch)
            forward_fixed, replay_fixed = max(select_blocks, loss_forward), loss_forward
            selection = act.kept_selection(cfg, s)
        layer_rest, backward_attention = rest, act.backward_attention(cfg, s, kda)
        frozen_indexer = False
        if adapted:
            own_indexer = not kda and cfg.indexer_types[i] == FULL
            d_attention, d_mlp, d_rest = lora_saved_change(cfg, s, i, trained[i], peft, own_indexer)
            attention, mlp, layer_rest = attention + d_attention, mlp + d_mlp, rest + d_rest
            frozen_indexer = lora_indexer_frozen(cfg, i, trained[i]) and s.indexer_loss
            if frozen_indexer:  # its loss has no gradient: no backward buffers for it
                backward_attention -= act.backward_attention(cfg, s, False) - \
                    act.backward_attention(cfg, replace(s, indexer_loss=False), False)
        layers.append(LayerBytes("KDA" if kda else "DSA", "MoE" if moe else "dense", attention, mlp, layer_rest,
                                 act.layer_input(cfg, s), act.backward_streams(cfg, s),
                                 backward_attention, act.backward_mlp(cfg, s, moe), fixed,
                                 forward_fixed, selection, replay_fixed, loss_fixed,
                                 0.0 if kda else act.saved_sparse_attention(cfg, s)))
        if frozen_indexer:  # no backward phase for the indexer loss
            layers[-1] = replace(layers[-1], loss_fixed=0.0)
        if adapted and i < inert:  # nothing here needs a gradient: it saves nothing and runs no backward
            layers[-1] = replace(layers[-1], attention=0.0, mlp_saved=0.0, rest=0.0, input=0.0, backward_streams=0.0,
                                 backward_attention=0.0, backward_mlp=0.0, backward_fixed=0.0, loss_fixed=0.0,
                                 attention_kernel=0.0)
        kinds[kind] = layers[-1]
    return layers


def kept(layer: LayerBytes, memory, cfg: ModelConfig, s: act.Shard) -> float:
    """What a layer keeps between its forward and its backward, per local token. A recomputed
    DSA layer keeps its token selection too, unless ``dsa_keep_selection`` is off."""
    selection = kept_selection(layer, memory)
    if memory.recompute == "full":
        return layer.input + selection
    if memory.recompute == "selective":
        keep = layer.saved
        block_input = cfg.hidden_size * s.a  # a recomputed module's input (the norm's output) stays
        if "attention" in memory.recompute_modules:
            keep += block_input - layer.attention + selection
        if ("mlp" in memory.recompute_modules and layer.mlp == "dense") or \
                ("moe" in memory.recompute_modules and layer.mlp == "MoE"):
            keep += block_input - layer.mlp_saved
        return keep
    return layer.saved


def kept_selection(layer: LayerBytes, memory) -> float:
    """The part of ``kept`` that is the DSA selection kept for the attention's recompute."""
    recomputed = memory.recompute == "full" or (memory.recompute == "selective"
                                                and "attention" in memory.recompute_modules)
    return layer.selection if recomputed and getattr(memory, "dsa_keep_selection", True) else 0.0


def pinned_size(nbytes: float) -> float:
    """The CUDA caching host allocator hands out pinned blocks rounded up to a power of two."""
    if nbytes <= 0:
        return 0.0
    return float(1 << (int(nbytes) - 1).bit_length())


# ------------------------------------------------------------------------------------ estimate
def shard_for(run: RunConfig, hw: Hardware) -> act.Shard:
    a = 2 if run.model.dtype == "bf16" else 4
    from genome_lm_kernels import resolve_backend

    backend = resolve_backend(run.model.kernel_backend, "cuda" if hw.device == "gpu" else "cpu")
    p = run.parallel
    return act.Shard(a=a, tp=p.tp, cp=p.cp, ep=p.ep, etp=p.etp, backend=backend,
                     indexer_loss=run.train.indexer_loss != "off", moe_imbalance=hw.moe_imbalance,
                     query_chunk=run.memory.dsa_query_chunk, sp=p.sequence_parallel and p.tp > 1,
                     gather_token_inputs=p.split_dsa_selection)


def world_size(run: RunConfig, hw: Hardware) -> int:
    """The run's GPUs: ``hw.gpus`` (--gpus), else the count the config states (``parallel.gpus``),
    else one micro-batch per data-parallel rank. They must hold the layout as the trainer's
    process groups do (``engine.parallel.ParallelSizes.check``)."""
    p = run.parallel
    gpus = hw.gpus or p.gpus or p.tp * p.cp * p.pp * (run.train.global_batch_size // run.train.micro_batch_size)
    what = f"--gpus {gpus}" if hw.gpus else f"parallel.gpus = {gpus}" if p.gpus else f"{gpus} GPUs"
    for sizes, product in (("tp x cp x pp", p.tp * p.cp * p.pp), ("ep x etp x pp", p.ep * p.etp * p.pp)):
        if gpus % product:
            raise GenomeLMError(f"{what} is not a multiple of {sizes} = {product}")
    return gpus


def in_flight(run: RunConfig, gpus: int, stage: int) -> int:
    """Micro-batches whose activations pipeline ``stage`` holds at once under the 1F1B schedule
    (``genome_lm.train.pipeline``): its warm-up forwards and the one before its first backward,
    at most the micro-batches a rank runs per step."""
    p = run.parallel
    micro = run.train.global_batch_size // (run.train.micro_batch_size * (gpus // (p.tp * p.cp * p.pp)))
    return max(1, min(p.pp - stage, micro))


def stage_plans(run: RunConfig, hw: Hardware = Hardware()) -> list[Plan]:
    """One plan per pipeline stage (one in all without pipeline parallel)."""
    cfg = model_config(run)
    check_split(cfg, run.parallel)
    gpus = world_size(run, hw)
    stages = pipeline_stages(cfg, run)
    return [_stage_plan(run, hw, cfg, gpus, i, offset, count, len(stages), stages[0][1])
            for i, (offset, count) in enumerate(stages)]


def check_split(cfg: ModelConfig, p) -> None:
    """That a ``parallel`` section splits the model: ep divides the experts, tp x cp the heads."""
    if cfg.n_routed_experts % p.ep:
        raise GenomeLMError(f"parallel.ep = {p.ep} does not divide the {cfg.n_routed_experts} experts")
    for name, heads in (("linear_num_heads", cfg.linear_num_heads), ("num_attention_heads", cfg.num_attention_heads)):
        if heads % (p.tp * p.cp):
            raise GenomeLMError(f"tp x cp = {p.tp * p.cp} does not divide the model's {heads} {name}")


def busiest(run: RunConfig, hw: Hardware = Hardware()) -> Plan:
    """The plan of the rank with the highest peak (under pipeline parallel, of the busiest
    stage), without the savings of ``estimate``: enough to tell whether a run fits."""
    return max(stage_plans(run, hw), key=lambda pl: pl.peak)


def estimate(run: RunConfig, hw: Hardware = Hardware()) -> Plan:
    """``busiest`` with what each memory switch saves."""
    plan = busiest(run, hw)
    mem = run.memory
    on_gpu = hw.device == "gpu"
    offload = mem.offload_activations and on_gpu

    # each switch against the same run without it, on the GPU's peak and in host memory: a
    # switch can save on one side and cost on the other (offload), or save only host memory
    # (recompute under offload shrinks what goes to the host)
    def saving(switch: str, against: str, **without) -> None:
        other = busiest(with_changes(run, memory=without), hw)
        plan.savings.append(Saving(switch, against, other.peak - plan.peak, other.host_per_gpu - plan.host_per_gpu))

    if mem.recompute != "none":
        how = {"full": " nested" if getattr(mem, "recompute_nested", False) else "",
               "selective": f" ({', '.join(mem.recompute_modules)})"}[mem.recompute]
        saving(f"recompute {mem.recompute}{how}", "none", recompute="none")
    if offload:
        saving("activation offload", "off", offload_activations=False)
    if mem.optimizer_offload and on_gpu:
        saving("optimizer offload", "off", optimizer_offload=False)
    if mem.moe_chunks > 1:  # against the whole MoE, so with the chunks' recompute, which needs chunks
        recomputed = ", each recomputed" if mem.moe_chunk_recompute else ""
        saving(f"MoE in {mem.moe_chunks} chunks{recomputed}", "whole", moe_chunks=1, moe_chunk_recompute=False)
    if mem.moe_chunk_recompute and mem.moe_chunks > 1:
        saving("each MoE chunk recomputed", f"the {mem.moe_chunks} chunks kept", moe_chunk_recompute=False)
    if mem.dsa_query_chunk:  # against the model's default of 64 queries per block
        saving(f"DSA query chunk {mem.dsa_query_chunk}", f"{act.DSA_DEFAULT_CHUNK}", dsa_query_chunk=None)
    return plan


def _stage_plan(run: RunConfig, hw: Hardware, cfg: ModelConfig, gpus: int, stage: int, offset: int, count: int,
                stages: int, first_stage: int) -> Plan:
    """The plan of one pipeline stage's rank (the whole model when ``stages`` is 1): its layers
    ``offset .. offset + count``, the embedding on the first stage, the loss head on the last,
    and the kept activations of every micro-batch in flight on it."""
    p, mem = run.parallel, run.memory
    first, last = stage == 0, stage == stages - 1
    flight = in_flight(run, gpus, stage)
    s = shard_for(run, hw)
    # under CP the trainer pads a sequence to a multiple of 2 x cp (two zigzag chunks per rank)
    padded = -(-run.data.seq_len // (2 * p.cp)) * 2 * p.cp if p.cp > 1 else run.data.seq_len
    T = padded // p.cp * run.train.micro_batch_size
    on_gpu = hw.device == "gpu"

    # static: parameters, gradients, optimizer; under LoRA the base is frozen (no gradient, no
    # optimizer state) and only the adapters and the tensors peft.train names have them
    layers_here = range(offset, offset + count)
    base = sum(local_count(parameter_split(cfg, layers_here, first, last), p.tp, p.ep, p.etp))
    adapters = sum(local_count(lora_parameters(cfg, run.peft, layers_here, first, last), p.tp, p.ep, p.etp)) \
        if lora(run) else 0.0
    local = base + adapters
    dense_local, expert_local = trained_locals(run, cfg, layers_here, first, last)
    dp_dense = gpus // (p.tp * p.pp)  # megatron-core shards dense state over data x context parallel
    dp_expert = gpus // (p.ep * p.etp * p.pp)
    distributed = on_gpu
    shard_params = dense_local / dp_dense + expert_local / dp_expert if distributed else dense_local + expert_local
    master = 4 if s.a == 2 else 0
    optimizer = shard_params * (master + 8)
    plan = Plan(run, cfg, hw, gpus, T, local, stage=stage, stages=stages, layers=layers_here, in_flight=flight)
    if lora(run):
        plan.device.append(Item("parameters", local * s.a, f"{local / 1e9:.2f}B on this GPU, of which "
                                 f"{adapters / 1e6:,.1f}M LoRA adapters (rank {run.peft.rank}); the base frozen"))
        plan.device.append(Item("gradients (fp32 buffer)", (dense_local + expert_local) * 4,
                                f"{(dense_local + expert_local) / 1e6:,.1f}M trained parameters (adapters"
                                f"{' and peft.train' if run.peft.train else ''})"))
    else:
        plan.device.append(Item("parameters", local * s.a, f"{local / 1e9:.2f}B on this GPU"))
        plan.device.append(Item("gradients (fp32 buffer)", local * 4, "megatron-core DDP, grad_reduce_in_fp32"))
    if mem.optimizer_offload and on_gpu:
        plan.device.append(Item("optimizer state", 0.0, "offloaded to host"))
        plan.host.append(Item("optimizer state + fp32 gradient shard", optimizer + shard_params * 4,
                              "optimizer CPU offload"))
    else:
        note = f"sharded over {dp_dense} (dense) / {dp_expert} (expert) ranks" if distributed else "torch AdamW"
        plan.device.append(Item("optimizer state", optimizer, note))

    # activations
    layers = layer_bytes(cfg, s, run.data.seq_len, run.train.micro_batch_size, run.peft,
                         inert_layers(run, cfg, first_stage))[offset:offset + count]
    if mem.moe_chunk_recompute and mem.moe_chunks > 1:  # a MoE keeps its input, and one chunk in backward
        moe_input = cfg.hidden_size * s.a * s.stream_tokens
        layers = [replace(lay, mlp_saved=moe_input + lay.mlp_saved / mem.moe_chunks)
                  if lay.mlp == "MoE" else lay for lay in layers]
    keeps = [kept(layer, mem, cfg, s) for layer in layers]
    offload = mem.offload_activations and on_gpu
    # the loss head: per token its input and norm; the vocabulary-wide tensors (softmax kept for
    # backward, logits, their fp32 copy and gradient) per position of one loss block when chunked
    vocab = cfg.vocab_size / s.tp * act.F32 + act.head_transient(cfg, s)
    head_tokens = min(T, mem.loss_chunk * run.train.micro_batch_size) if mem.loss_chunk else T
    saved_head = act.saved_head(cfg, s)
    if lora(run):  # the final norm's and the output layer's inputs go with their weights frozen
        saved_head += lora_head_change(cfg, s, lora_trained(cfg, run.peft)[1], run.peft)
    head_bytes = (saved_head + act.head_transient(cfg, s) - vocab) * T + vocab * head_tokens
    on_device = [0.0 if offload else k for k in keeps]
    if not last:
        head_bytes = 0.0
    # under 1F1B the stage's other micro-batches in flight keep what its layers keep meanwhile
    others = (flight - 1) * sum(on_device) * T
    candidates = [(sum(on_device) * T + head_bytes, "loss (end of forward)" if last else "end of forward")]
    # recompute of layer i's attention in backward runs the forward's working blocks again
    recomputes_attention = mem.recompute == "full" or (mem.recompute == "selective"
                                                        and "attention" in mem.recompute_modules)
    for i, layer in enumerate(layers):
        n = offset + i  # the layer's number in the model
        if layer.mlp == "MoE":  # the dispatcher's buffers, one MoE chunk at a time
            before = 0.0 if offload else sum(on_device[:i])
            dispatch = act.moe_dispatch(cfg, s, mem.moe_chunks)
            candidates.append(((before + layer.saved + dispatch) * T, f"forward of layer {n} (MoE dispatch)"))
            if mem.recompute == "full":
                grads = act.layer_input(cfg, s)
                candidates.append(((before + (0.0 if offload else on_device[i]) + grads + layer.saved + dispatch) * T,
                                   f"recompute of layer {n} (MoE dispatch)"))
        if layer.forward_fixed:
            before = 0.0 if offload else sum(on_device[:i])
            candidates.append(((before + layer.partial) * T + layer.forward_fixed,
                               f"forward of layer {n} ({layer.kind} indexer blocks)"))
            if recomputes_attention:
                grads = act.layer_input(cfg, s)  # the layer's output gradient is waiting
                # the recompute replays a kept selection: only the indexer loss's blocks run
                fixed = layer.replay_fixed if kept_selection(layer, mem) else layer.forward_fixed
                candidates.append(((before + (0.0 if offload else on_device[i]) + grads + layer.partial) * T
                                   + fixed, f"recompute of layer {n} ({layer.kind} indexer blocks)"))
    # A layer's backward runs its MLP half first, with everything the layer saved alive; autograd
    # frees the MLP half's saved tensors (and its mHC's and norm's) before the attention's
    # backward starts, so the attention's buffers and working blocks meet only the first half.
    # recompute_nested (full recompute with the attention and MLP blocks checkpointed inside each
    # layer): each half holds its mHC/norm tensors and the blocks' inputs, and one block at a time.
    nested = mem.recompute == "full" and getattr(mem, "recompute_nested", False)
    block_input = cfg.hidden_size * s.a
    for i, layer in enumerate(layers):
        n = offset + i
        if nested:
            mlp_half = layer.rest + 2 * block_input + layer.mlp_saved
            attention_half = layer.rest / 2 + block_input + layer.attention
        else:
            mlp_half, attention_half = layer.saved, layer.partial
        before = 0.0 if offload else sum(on_device[:i])  # offload: layers come back one at a time
        phases = [(before + mlp_half + layer.backward_streams + layer.backward_mlp) * T,
                  (before + attention_half + layer.backward_streams + layer.backward_attention) * T
                  + layer.backward_fixed]
        if layer.loss_fixed:  # the indexer loss's backward runs after the sparse attention's
            phases.append((before + attention_half - layer.attention_kernel + layer.backward_streams
                           + layer.backward_attention) * T + layer.loss_fixed)
        candidates.append((max(phases), f"backward of layer {n} ({layer.kind}, {layer.mlp})"))
    act_peak, where = max(candidates, key=lambda c: c[0])
    if stages > 1:
        where = f"stage {stage} of {stages}: {where}"
        plan.device.append(Item("activations at the peak", act_peak + others,
                                f"{where}; {flight} micro-batch{'es' if flight > 1 else ''} in flight"))
    else:
        plan.device.append(Item("activations at the peak", act_peak, where))
    plan.peak_where = where

    # per layer type, saved (before recompute / offload)
    for kind in ("KDA", "DSA"):
        for mlp in ("dense", "MoE"):
            group = [lay for lay in layers if lay.kind == kind and lay.mlp == mlp]
            if group:
                lay = group[0]
                note = (f"attention {lay.attention * T / GiB:.2f} GiB, {mlp} {lay.mlp_saved * T / GiB:.2f} GiB, "
                        f"mHC/norms {lay.rest * T / GiB:.2f} GiB, backward buffers "
                        f"{(lay.backward * T + max(lay.backward_fixed, lay.loss_fixed)) / GiB:.2f} GiB per layer")
                if lay.forward_fixed:
                    note += f"; indexer query blocks {lay.forward_fixed / GiB:.2f} GiB in forward"
                if mlp == "MoE":
                    note += (f"; dispatch buffers {act.moe_dispatch(cfg, s, mem.moe_chunks) * T / GiB:.2f} GiB "
                             f"({mem.moe_chunks} chunks, busiest rank x{s.moe_imbalance if p.ep > 1 else 1:g})")
                plan.activations.append(Item(f"{len(group)} x {kind} + {mlp}", lay.saved * T, note))
    if last:
        plan.activations.append(Item("loss head", head_bytes, f"vocabulary {cfg.vocab_size} / tp {p.tp}"
                                     + (f", in blocks of {mem.loss_chunk} positions" if mem.loss_chunk else "")))

    if offload:
        # a recomputed DSA layer's kept selection is a host block of its own, beside the layer's
        # saved tensors
        blocks = []
        for layer, k in zip(layers, keeps):
            selection = kept_selection(layer, mem)
            blocks += [(k - selection) * T, selection * T]
        host = flight * (sum(pinned_size(b) for b in blocks) if mem.offload_pinned else sum(blocks))
        # the layers' inputs (per position of this GPU's stream slice), the published figure
        plan.offloaded_per_token = sum(blocks[::2]) / T / s.stream_tokens
        note = "pinned: blocks rounded up to powers of two" if mem.offload_pinned else "pageable"
        if flight > 1:
            note += f", {flight} micro-batches in flight"
        plan.host.append(Item("offloaded activations", host, note))
    return plan


def inert_layers(run: RunConfig, cfg: ModelConfig, first_stage: int) -> int:
    """Leading layers of the first pipeline stage (``first_stage`` layers) that run no backward
    under ``run``'s LoRA (``plan.peft.inert_layers``); 0 when training whole."""
    return lora_inert_layers(cfg, run.peft, first_stage) if lora(run) else 0


def trained_locals(run: RunConfig, cfg: ModelConfig, layers: range, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters one rank of a pipeline stage (``layers``, with the embedding
    when ``first``, the head when ``last``) computes gradients and optimizer steps for: all of
    them, or under LoRA the adapters and the tensors ``peft.train`` names."""
    p = run.parallel
    split = trainable_split(cfg, run.peft, layers, first, last) if lora(run) else \
        parameter_split(cfg, layers, first, last)
    return local_count(split, p.tp, p.ep, p.etp)


def host_heap(run: RunConfig, ranks_here: int, memory: int | None = None) -> RunConfig:
    """``run`` with ``memory.host_heap: auto`` resolved for a CPU run of ``ranks_here`` ranks on
    this machine: "keep" where twice the planned peak fits a rank's share, else "return"
    (``engine.allocator``)."""
    if run.memory.host_heap != "auto":
        return run
    world = max(ranks_here, run.parallel.tp * run.parallel.cp * run.parallel.pp)
    peak = estimate(run, Hardware(device="cpu", gpus=world)).peak
    return with_changes(run, memory={"host_heap": "keep" if heap_fits(peak, ranks_here, memory) else "return"})


def with_changes(run: RunConfig, **sections) -> RunConfig:
    """``run`` with fields changed per section: with_changes(run, parallel={"cp": 2})."""
    update = {name: getattr(run, name).model_copy(update=fields) for name, fields in sections.items()}
    return run.model_copy(update=update)


__all__ = ["Hardware", "Plan", "Item", "Saving", "busiest", "estimate", "stage_plans", "parameter_split",
           "model_config", "with_changes", "GiB", "pinned_size", "trained_locals", "inert_layers"]
