"""Time of one training step per GPU, from a ``RunConfig``: tokens/s, MFU and what bounds it.

    timing = estimate_time(run, Hardware(...))

A roofline sum with two overlaps: genome-lm's trainer runs the parts of a step one after the
other on one CUDA stream (communication on the default stream, offload through
``torch.autograd.graph.save_on_cpu``, whose device-to-host copy blocks), so the step time is the
sum of its parts on the busiest GPU, less what the config overlaps (below):

    compute        per piece of ``model.flops`` (recompute included), this GPU's share of the
                   FLOPs / (bf16 tensor-core peak x efficiency of its class: "gemm" for the
                   linear layers and experts, "kernel" for the attention-like kernels: KDA,
                   sparse attention, the DSA indexer and its loss); the busiest expert rank
                   does ``moe_imbalance`` times the mean expert work
    memory         elementwise work charged by bytes at HBM bandwidth: every activation byte a
                   layer saves (``plan.activations``) is written by each forward run of it and
                   read, with its gradient written and read, in backward; the DSA selection's
                   scores (8 bytes per query-pool pair: written, then read by the top-k)
    communication  tensor parallel (sequence-parallel all-gather and reduce-scatter around the
                   attention, the dense MLP and the shared expert), context parallel (the KDA
                   and DSA head all-to-alls, the indexer's gathered inputs), the shared DSA
                   selection (its int32 pools all-gathered, its loss targets reduced onto
                   their owners; ``parallel.split_dsa_selection``), expert parallel
                   (dispatch and combine all-to-all per MoE run, the busiest rank receiving
                   ``moe_imbalance`` times the mean, over the network for the part of its
                   group outside its node), data parallel (the distributed optimizer's
                   fp32 gradient reduce-scatter and bf16 parameter all-gather), pipeline
                   parallel (the 1F1B bubble, (pp - 1) / micro-batches of the step)
    host           activation offload (device-to-host in forward, back in backward, and the
                   pinned blocks allocated anew each step, since the trainer releases the
                   host cache after each step), optimizer offload (gradients down,
                   parameters up, Adam on the CPU at host memory bandwidth)

Under LoRA (``peft.method: lora``, ``plan.peft.lora_work``) a frozen projection's backward is
its input's gradient only, the adapters' thin products are added (their time charged by the
memory they move: "LoRA adapters on MoE layers (memory traffic)", one row per layer kind), and
the data-parallel reduction and the optimizer step cover the adapters and ``peft.train``'s
tensors only.

What overlaps with what (each overlapped part is listed in ``Timing.hidden`` and left out of the
sum; its item keeps the exposed rest):

    parallel.overlap_grad_reduce   megatron-core DDP reduces (or reduce-scatters) each gradient
                   bucket over data parallel as soon as the last micro-batch's backward has filled
                   it: the fp32 gradient part of "data parallel" runs under that backward's
                   compute, except the last bucket's (DDP's bucket, 40M parameters or 1M x dp,
                   whichever is larger), which nothing follows; the bf16 parameter all-gather
                   after the optimizer step stays exposed (``overlap_param_gather`` is not used)
    parallel.moe_shared_expert_overlap   megatron-core's MoE layer runs the shared expert on a
                   second stream while the routed tokens' all-to-alls run: the shared expert's
                   compute hides that much of "expert parallel" (or all of it, if smaller)

Overlapped communication is assumed not to slow the compute it runs under, nor the other
communication (no shared-link contention is modelled).

Every rate is a figure of ``engine.devices.SPECS`` times one efficiency of ``CONSTANTS``; each
constant is used once, in ``estimate_time``. One of them, ``kernel``, is fitted to the published
run's 13,700 tokens/s at 1M (``fit_kernel_efficiency``); the others are public measurements
(docs/plan.md, "The time model", says which). The model is checked against the published run's
other figures (24,900 tokens/s at 256k, +21% step time for offload at 256k) in
``tests/plan/test_time_model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from genome_lm.config import RunConfig
from genome_lm.engine.devices import GPUSpec
from genome_lm.model import flops

from .hardware import gpu_spec
from .memory_model import Hardware, inert_layers, layer_bytes, shard_for, stage_plans, trained_locals, with_changes
from .peft import lora, lora_work

KERNELS = {"KDA recurrence", "DSA indexer selection", "DSA indexer loss target", "DSA indexer loss scores",
           "DSA sparse attention", "DSA sparse attention (dense blocks)", "DSA sparse attention (gathered)"}
SCORE_BYTES = 8  # per query-pool pair of the DSA selection: the fp32 score written, then read by the top-k
ADAM_BYTES = 28  # per parameter of an Adam step: fp32 parameter, gradient, two moments read; parameter, moments written
DDP_BUCKET = 40_000_000  # parameters per megatron-core DDP bucket under overlap_grad_reduce (at least 1M x dp)


@dataclass(frozen=True)
class Constants:
    """Achieved fractions of the ``GPUSpec`` rates, and the host's pinning rate."""

    gemm: float = 0.80  # large bf16 GEMMs: 790 of 989 TFLOP/s measured on the lent H200 (docs/design.md, section 5)
    kernel: float = 0.0465  # attention-like kernels: fitted on 13,700 tokens/s at 1M (fit_kernel_efficiency)
    hbm: float = 0.80  # streaming kernels' share of HBM bandwidth
    nvlink: float = 0.80  # NCCL bus bandwidth inside a node over the link rate
    network: float = 0.80  # NCCL bus bandwidth over InfiniBand over the NIC rate
    host_link: float = 0.80  # pinned copies over PCIe Gen5 x16 (about 51 of 64 GB/s)
    host_memory: float = 0.50  # CPU Adam's share of the node's DRAM bandwidth
    pin_rate: float = 5e9  # bytes/s of pinned host memory cudaHostAlloc hands out (page-locking)


CONSTANTS = Constants()


@dataclass
class TimeItem:
    name: str
    layer: str  # "KDA", "DSA", "dense MLP", "MoE", "mHC", "head", or "" for the step's own parts
    resource: str  # "compute", "memory", "communication", "host", "idle" (the pipeline bubble)
    seconds: float  # per step on the busiest GPU


@dataclass
class Timing:
    """One step's predicted time on the busiest GPU, split by part."""

    run: RunConfig
    gpu: GPUSpec
    gpus: int
    tokens_per_step: int
    items: list[TimeItem] = field(default_factory=list)
    model_flops_per_gpu: float = 0.0  # forward + backward of the step's work, no recompute, mean GPU
    hidden: list[TimeItem] = field(default_factory=list)  # overlapped parts, not in the step's sum

    def overlap(self, name: str, seconds: float, under: str) -> None:
        """Hide ``seconds`` of item ``name`` under other work (``under``: what it runs beside):
        the item keeps the exposed rest, the hidden part is listed in ``hidden``."""
        item = next(i for i in self.items if i.name == name)
        seconds = min(seconds, item.seconds)
        if seconds > 0:
            item.seconds -= seconds
            self.hidden.append(TimeItem(f"{name} under {under}", item.layer, item.resource, seconds))

    @property
    def step_seconds(self) -> float:
        return sum(i.seconds for i in self.items)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops_per_gpu / self.step_seconds / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops_per_gpu / self.step_seconds / self.gpu.bf16_flops

    def by(self, key: str) -> dict[str, float]:
        """Seconds summed by ``key`` ("resource", "layer" or "name"), largest first."""
        out: dict[str, float] = {}
        for item in self.items:
            name = getattr(item, key) or "step-wide (not per layer)"
            out[name] = out.get(name, 0.0) + item.seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def bound(self) -> tuple[str, float, TimeItem]:
        """The resource with the most time, its share of the step and its largest part."""
        resource, seconds = next(iter(self.by("resource").items()))
        top = max((i for i in self.items if i.resource == resource), key=lambda i: i.seconds)
        return resource, seconds / self.step_seconds, top

    @property
    def bottleneck(self) -> str:
        """The resource with the most time, and its largest part."""
        resource, share, top = self.bound()
        return f"{resource} ({share:.0%} of the step; largest part: {top.name}, {top.seconds / self.step_seconds:.0%})"

    def as_dict(self) -> dict:
        return {"step_seconds": self.step_seconds, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "tflops_per_gpu": self.tflops_per_gpu,
                "mfu": self.mfu, "bottleneck": self.bottleneck, "gpu": self.gpu.name, "gpus": self.gpus,
                "by_resource": self.by("resource"), "by_layer": self.by("layer"),
                "items": [vars(i) for i in self.items], "hidden": [vars(i) for i in self.hidden]}


def _link(peer_stride: int, gpus_per_node: int, gpu: GPUSpec, c: Constants) -> float:
    """Bytes/s between ranks ``peer_stride`` apart: NVLink inside a node, else the network."""
    return gpu.nvlink * c.nvlink if peer_stride < gpus_per_node else gpu.network * c.network


def _group_seconds(nbytes: float, stride: int, size: int, gpus_per_node: int, gpu: GPUSpec, c: Constants) -> float:
    """Seconds for a GPU to exchange ``nbytes`` evenly with the other members of a group of
    ``size`` ranks ``stride`` apart (an all-to-all, all-gather or reduce): the share bound for
    members on other nodes goes over the network, the rest over NVLink, at the same time."""
    if size <= 1:
        return 0.0
    in_node = min(size, max(1, gpus_per_node // stride))  # this GPU's group members on its node, itself included
    remote = nbytes * (size - in_node) / (size - 1)
    return max(remote / (gpu.network * c.network), (nbytes - remote) / (gpu.nvlink * c.nvlink))


def estimate_time(run: RunConfig, hw: Hardware = Hardware(), gpu: GPUSpec | None = None,
                  c: Constants = CONSTANTS) -> Timing:
    """The step time of ``run`` on ``hw`` (its busiest pipeline stage, its busiest expert rank)."""
    gpu = gpu or gpu_spec(hw.gpu_name)
    plans = stage_plans(run, hw)
    plan = max(plans, key=lambda pl: len(pl.layers))  # the stage with the most layers
    cfg, p, mem, tr = plan.model, run.parallel, run.memory, run.train
    gpus, node = plan.gpus, hw.gpus_per_node
    dp = gpus // (p.tp * p.cp * p.pp)
    micro = tr.global_batch_size // (tr.micro_batch_size * dp)  # micro-batches per rank per step
    T, B = run.data.seq_len, tr.micro_batch_size
    s = shard_for(run, hw)
    a = s.a
    local = T * B / p.cp  # tokens of this rank's part of a micro-batch
    mode = tr.indexer_loss
    last = plan.stage == plan.stages - 1 or plan.stages == 1
    work = flops.step_work(cfg, mem, T=T, batch=B, indexer_loss_mode=mode, gpu=True, layers=plan.layers, head=last)
    adapter_bytes: list[flops.Work] = []
    inert = inert_layers(run, cfg, len(plans[0].layers))  # LoRA: leading layers that run no backward
    if lora(run):  # a frozen base's backward, the adapters' products and the memory they move
        work, adapter_bytes = lora_work(work, cfg, run, T=T, batch=B, gpu=True, layers=plan.layers, head=last, a=a,
                                        inert=inert)
    par = parallel_split(p, hw)
    timing = Timing(run, gpu, gpus, tr.global_batch_size * T)
    add = timing.items.append

    # compute: each piece at its class's efficiency
    for w in work:
        add(TimeItem(w.name, w.layer, "compute", compute_seconds(w, micro * w.total, par, gpu, c)))
    if lora(run):
        whole, _ = lora_work(flops.step_work(cfg, mem, T=T, batch=B, indexer_loss_mode=mode, gpu=True), cfg, run,
                             T=T, batch=B, gpu=True, a=a, inert=inert)
        model_flops = sum(w.count * (w.forward + w.backward) for w in whole)
    else:
        model_flops = flops.model_flops(cfg, mem, T=T, batch=B, indexer_loss_mode=mode, gpu=True)
    timing.model_flops_per_gpu = model_flops * (tr.global_batch_size // B) / gpus

    # memory-bound: saved activations written per forward run, read (with their gradient) in backward
    runs = 1 + (1 if mem.recompute == "full" else 0.5 if mem.recompute == "selective" else 0)
    hbm = gpu.hbm * c.hbm
    saved = sum(lay.saved for lay in layer_bytes(cfg, s, T, B, run.peft, inert)[plan.layers.start:plan.layers.stop])
    add(TimeItem("activations (elementwise)", "", "memory", micro * saved * local * (runs + 3) / hbm))
    moved: dict[str, float] = {}  # the adapters' thin products read and write whole activations: bound by memory
    for w in adapter_bytes:
        moved[w.layer] = moved.get(w.layer, 0.0) + micro * w.total / par.divisor(w.split) / hbm
    for layer, seconds in moved.items():
        add(TimeItem(f"LoRA adapters on {layer} layers (memory traffic)", layer, "memory", seconds))
    pairs = selection_pairs(cfg, work)
    if pairs:
        add(TimeItem("DSA selection scores (top-k)", "DSA", "memory",
                     micro * pairs * SCORE_BYTES / par.divisor("queries") / hbm))

    # communication, per micro-batch unless stated
    layers = list(plan.layers)
    moe_layers = [i for i in layers if cfg.mlp_layer_types[i] != "dense"]
    passes = 2 + (runs - 1)  # forward, backward, replays
    if p.tp > 1:
        add(TimeItem("tensor parallel (all-gather, reduce-scatter)", "", "communication",
                     micro * passes * tp_bytes(cfg, p, len(layers), local, a) / _link(1, node, gpu, c)))
    if p.cp > 1:
        add(TimeItem("context parallel (head all-to-all, gathers)", "", "communication",
                     micro * passes * _group_seconds(cp_bytes(cfg, p, layers, local, T * B, a), p.tp, p.cp, node,
                                                     gpu, c)))
    shared = selection_share_bytes(cfg, p, mem, layers, T, B, mode, runs)
    if shared:
        add(TimeItem("DSA shared selection (pool all-gather, loss-target reduce)", "DSA", "communication",
                     micro * _group_seconds(shared, 1, p.tp * p.cp, node, gpu, c)))
    if p.ep > 1 and moe_layers:
        routed = next(w for w in work if w.name == "MoE routed experts")
        moe_runs = 1 + round(routed.replay / routed.forward)  # the forward and what recompute replays of it
        a2a = 2 * (moe_runs + 1)  # dispatch and combine per forward run, and both again in backward
        add(TimeItem("expert parallel (all-to-all)", "MoE", "communication",
                     micro * a2a * len(moe_layers) * all_to_all_seconds(cfg, p, local, a, hw, gpu, c)))
    # what has gradients and optimizer state (under LoRA the adapters and peft.train's tensors)
    dense, experts = trained_locals(run, cfg, plan.layers, plan.stage == 0, last)
    dp_dense, dp_expert = gpus // (p.tp * p.pp), gpus // (p.ep * p.etp * p.pp)
    grad_bytes = sum(n * (4 + 2) * (d - 1) / d for n, d in ((dense, dp_dense), (experts, dp_expert)) if d > 1)
    if grad_bytes:  # once per step: fp32 gradients reduce-scattered, bf16 parameters all-gathered
        dp_item = "data parallel (gradients, parameters)"
        dp_seconds = grad_bytes / _link(p.tp * p.cp * p.pp, node, gpu, c)
        add(TimeItem(dp_item, "", "communication", dp_seconds))
        if getattr(p, "overlap_grad_reduce", False):
            # the gradient part (4 of the 6 bytes) under the last micro-batch's backward, but its last bucket
            reduce = dp_seconds * 4 / 6
            last_bucket = reduce * min(1.0, max(DDP_BUCKET, 1e6 * max(dp_dense, dp_expert)) / (dense + experts))
            backward = sum(compute_seconds(w, w.total - w.count * w.forward, par, gpu, c) for w in work)
            timing.overlap(dp_item, min(reduce - last_bucket, backward), "the last micro-batch's backward")
    if getattr(p, "moe_shared_expert_overlap", False) and p.ep > 1 and moe_layers:
        shared_expert = sum(i.seconds for i in timing.items if i.name == "MoE shared expert")
        timing.overlap("expert parallel (all-to-all)", shared_expert, "the shared expert")
    if p.pp > 1:  # 1F1B: every stage idles for pp - 1 micro-batch slots of forward and backward
        busy = sum(i.seconds for i in timing.items if i.resource != "host")
        add(TimeItem("pipeline bubble", "", "idle", (p.pp - 1) / micro * busy))

    # host: activation offload, optimizer offload
    if mem.offload_activations:
        pinned = sum(i.bytes for i in plan.host if i.name == "offloaded activations")
        moved = sum(i.bytes for i in max(stage_plans(with_changes(run, memory={"offload_pinned": False}), hw),
                                         key=lambda pl: len(pl.layers)).host if i.name == "offloaded activations")
        moved /= plan.in_flight  # one micro-batch's blocks
        add(TimeItem("activation offload (copies)", "", "host", micro * 2 * moved / (gpu.host_link * c.host_link)))
        if mem.offload_pinned:
            add(TimeItem("activation offload (pinning host memory)", "", "host", pinned / c.pin_rate))
    shard = dense / dp_dense + experts / dp_expert
    if mem.optimizer_offload:
        add(TimeItem("optimizer offload (gradients down, parameters up)", "", "host",
                     shard * (4 + a) / (gpu.host_link * c.host_link)))
        add(TimeItem("optimizer step (CPU Adam)", "", "host",
                     shard * ADAM_BYTES * min(gpus, node) / (gpu.host_memory * c.host_memory)))
    else:
        add(TimeItem("optimizer step (GPU Adam)", "", "memory", shard * ADAM_BYTES / hbm))
    return timing


# ------------------------------------------- the parts a forward shares (``plan.eval_model`` too)
def compute_seconds(w: flops.Work, work_flops: float, par: flops.Parallel, gpu: GPUSpec, c: Constants) -> float:
    """``work_flops`` of piece ``w`` on the busiest GPU at its class's efficiency."""
    eff = c.kernel if w.name in KERNELS else c.gemm
    return work_flops / par.divisor(w.split) / (gpu.bf16_flops * eff)


def parallel_split(p, hw: Hardware) -> flops.Parallel:
    """How a replica of layout ``p`` (a ``ParallelConfig``) divides the work (``flops.per_gpu``)."""
    return flops.Parallel(p.tp, p.cp, p.sequence_parallel and p.tp > 1, hw.moe_imbalance if p.ep > 1 else 1.0,
                          share_queries=p.split_dsa_selection and p.tp * p.cp > 1)


def selection_share_bytes(cfg, p, memory, layers, T: int, B: int, indexer_loss: str, runs: float) -> float:
    """Bytes a GPU receives in one micro-batch for the DSA selection shared out over its tp x cp
    group (``parallel.split_dsa_selection``): the other ranks' int32 pools per forward run that
    selects (an all-gather; a recompute replays the kept selection), and with the indexer loss
    its fp32 target blocks reduced onto their owners in each forward run and in backward (which
    computes them again unless the kernel keeps them). 0 without the split."""
    n = p.tp * p.cp
    if not (getattr(p, "split_dsa_selection", False) and n > 1):
        return 0.0
    from genome_lm_kernels.dsa.loss import KEEP_TARGET_BYTES, _target_bytes
    from genome_lm_kernels.dsa.reference import slot_width

    indexed = sum(1 for i in layers if cfg.layer_types[i] != "linear_attention" and cfg.indexer_types[i] == "full")
    kpool, N = cfg.index_kpool, T // cfg.index_kpool
    pools = B * T * min(cfg.index_topk // kpool, N) * 4
    selections = 1 + (0 if memory.dsa_keep_selection else runs - 1)
    total = selections * pools
    if indexer_loss != "off":
        chunk = memory.dsa_query_chunk or flops.DSA_CHUNK
        S = slot_width(cfg.index_topk, kpool) if indexer_loss == "sparse" else None
        target = _target_bytes(B, T, N, S, kpool, chunk, 4)
        total += (runs + (0 if target <= KEEP_TARGET_BYTES else 1)) * target
    return indexed * total * (n - 1) / n


def selection_pairs(cfg, work: list[flops.Work]) -> float:
    """Query-pool pairs the DSA selection scores in one forward (its scores are written, then read)."""
    return sum(w.count * w.forward / (2 * cfg.index_n_heads * cfg.index_head_dim)
               for w in work if w.name == "DSA indexer selection")


def tp_bytes(cfg, p, layers: int, local: float, a: int) -> float:
    """Bytes a GPU moves for tensor parallel in one pass over ``layers`` layers: an all-gather and a
    reduce-scatter around the attention, and around the dense MLP or shared expert."""
    collectives = 2 * layers + 2 * layers
    return collectives * local * cfg.hidden_size * a * (p.tp - 1) / p.tp


def cp_bytes(cfg, p, layers, local: float, tokens: float, a: int) -> float:
    """Bytes a GPU moves for context parallel in one pass over ``layers`` (indices): KDA's head
    all-to-all of q, k, v, g, beta and o (fp32); DSA's of q and o, and of all ``tokens`` the MLA
    latent gathered and, where the layer has its own indexer, the indexer's per-token inputs
    (keys and gate logits, fp32 head weights) and the low-rank q_resid it makes queries of."""
    frac = (p.cp - 1) / p.cp
    D = cfg.hidden_size
    kda = [i for i in layers if cfg.layer_types[i] == "linear_attention"]
    W, H = cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_num_heads
    per_kda = local * (3 * W * a + 4 * W + 4 * H + 4 * W) / p.tp * frac
    dsa = [i for i in layers if cfg.layer_types[i] != "linear_attention"]
    indexed = [i for i in dsa if cfg.indexer_types[i] == "full"]
    Hq, L = cfg.num_attention_heads, cfg.kv_lora_rank
    per_dsa = local * (Hq * cfg.qk_head_dim * a + Hq * L * a) / p.tp * frac + tokens * L * a * frac
    if getattr(p, "split_dsa_selection", False):  # keys, gate logits, fp32 head weights and q_resid
        per_indexer = tokens * ((2 * cfg.index_head_dim + cfg.q_lora_rank) * a + 4 * cfg.index_n_heads) * frac
    else:  # the published layout: the hidden state and q_resid
        per_indexer = tokens * (D + cfg.q_lora_rank) * a * frac
    return len(kda) * per_kda + len(dsa) * per_dsa + len(indexed) * per_indexer


def all_to_all_seconds(cfg, p, local: float, a: int, hw: Hardware, gpu: GPUSpec, c: Constants) -> float:
    """One MoE dispatch (or combine) all-to-all on the busiest expert rank, which receives
    ``moe_imbalance`` times the mean, over the network for the part of its group outside its node."""
    received = local / p.tp * cfg.num_experts_per_tok * cfg.hidden_size * a * hw.moe_imbalance
    # the share routed to this rank's own experts stays; the rest comes from the other members
    seconds = _group_seconds(received * (p.ep - 1) / p.ep, p.etp, p.ep, hw.gpus_per_node, gpu, c)
    if p.etp > 1:  # the expert-tensor-parallel pair gathers each other's tokens, inside the node
        seconds += received * (p.etp - 1) / p.etp / (gpu.nvlink * c.nvlink)
    return seconds


def fit_kernel_efficiency(run: RunConfig, tokens_per_s: float, hw: Hardware = Hardware(),
                          c: Constants = CONSTANTS) -> float:
    """The ``kernel`` efficiency at which ``run`` reaches ``tokens_per_s`` (bisection: the
    predicted rate grows with it)."""
    lo, hi = 1e-4, 1.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if estimate_time(run, hw, c=replace(c, kernel=mid)).tokens_per_s < tokens_per_s:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


__all__ = ["CONSTANTS", "Constants", "TimeItem", "Timing", "estimate_time", "fit_kernel_efficiency"]
