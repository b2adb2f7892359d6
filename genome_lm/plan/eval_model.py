"""Memory per GPU and time of `genome-lm eval` over many ranks, from a ``RunConfig``: how many GPUs
the scoring of a chromosome needs at a window length, and how long it takes.

    plan = estimate_eval(run, hw, gpu)            # the run's parallel section is the eval layout
    best = smallest_eval_layout(run, hw, gpu)     # the fewest GPUs whose layout fits, fastest first

Scoring is one forward per window with no gradients and no optimizer (``eval.parallel``): a
window group of tp x cp ranks (the whole job under expert parallelism, whose MoE dispatch spans
the data-parallel ranks) runs it split, and the cross-entropy is taken over the vocabulary shards.

Memory on the busiest GPU, per window:
    weights          bf16: replicated + tensor / tp + experts / (ep x etp) (``parameter_split``)
    streams          the mHC residual streams, a layer's input and its output at once
    largest layer    the largest layer's forward intermediates at once: its saved activations per
                     token (``layer_bytes``, what a training forward keeps) and its fixed working
                     blocks (the DSA selection's query blocks). An upper bound: without gradients
                     each intermediate is freed once the next has used it
    logits           this rank's vocabulary shard of one block's logits (bf16; ``HEAD_CHUNK``
                     positions at a time) and the cross-entropy's fp32 copy and exponentials
Time of one window on a group: the training time model's parts (``plan.time_model``) for a forward
alone: its FLOPs (``model.flops``: the ``forward`` of each piece, no indexer loss, no recompute)
at the same efficiencies, its activations written once, the DSA selection's scores, and one pass
of the tensor-, context- and expert-parallel communication. Tokens/s is the groups scoring at once
times the window over that time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from genome_lm.config import RunConfig
from genome_lm.engine.devices import GPUSpec
from genome_lm.errors import GenomeLMError
from genome_lm.model import flops

from .memory_model import (
    Hardware,
    Item,
    check_split,
    layer_bytes,
    model_config,
    parameter_split,
    shard_for,
    with_changes,
)
from .time_model import (
    CONSTANTS,
    SCORE_BYTES,
    Constants,
    TimeItem,
    _group_seconds,
    _link,
    all_to_all_seconds,
    compute_seconds,
    cp_bytes,
    parallel_split,
    selection_pairs,
    selection_share_bytes,
    tp_bytes,
)


@dataclass
class EvalPlan:
    run: RunConfig
    hw: Hardware
    gpu: GPUSpec | None
    gpus: int
    groups: int  # windows scored at once
    memory: list[Item] = field(default_factory=list)
    time: list[TimeItem] = field(default_factory=list)

    @property
    def layout(self) -> dict:
        p = self.run.parallel
        return {"tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "sequence_parallel": p.sequence_parallel}

    @property
    def peak(self) -> float:
        return sum(i.bytes for i in self.memory)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hw.usable

    @property
    def window_seconds(self) -> float:
        return sum(i.seconds for i in self.time)

    @property
    def tokens_per_s(self) -> float:
        return self.groups * self.run.data.seq_len / self.window_seconds if self.time else float("nan")

    def layout_text(self) -> str:
        p = self.run.parallel
        parts = [f"{k}={v}" for k, v in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep), ("etp", p.etp)) if v > 1]
        return f"{self.gpus} GPUs, " + (" ".join(parts) or "one GPU per window") + \
            (" sp" if p.sequence_parallel and p.tp > 1 else "")

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "layout": self.layout, "groups": self.groups, "seq_len": self.run.data.seq_len,
                "peak_bytes": self.peak, "usable_bytes": self.hw.usable, "fits": self.fits,
                "memory": [vars(i) for i in self.memory],
                "window_seconds": self.window_seconds if self.time else None,
                "tokens_per_s": self.tokens_per_s if self.time else None,
                "time": [vars(i) for i in self.time]}


def _check(run: RunConfig, gpus: int) -> None:
    p = run.parallel
    if p.pp > 1:
        raise GenomeLMError("plan --eval models tensor, context and expert parallel; pipeline stages (which eval "
                            "can use) are not planned yet: plan it with --pp 1")
    check_split(model_config(run), p)
    if gpus % (p.tp * p.cp) or gpus % (p.ep * p.etp):
        raise GenomeLMError(f"{gpus} GPUs do not hold tp x cp = {p.tp * p.cp} and ep x etp = {p.ep * p.etp}")


def estimate_eval(run: RunConfig, hw: Hardware = Hardware(), gpu: GPUSpec | None = None,
                  c: Constants = CONSTANTS) -> EvalPlan:
    """The eval of windows of ``run.data.seq_len`` tokens on ``hw.gpus`` GPUs (default: tp x cp x
    ep x etp's largest) split by ``run.parallel``; its time when ``gpu`` is given."""
    p = run.parallel
    gpus = hw.gpus or max(p.tp * p.cp, p.ep * p.etp)
    _check(run, gpus)
    run = with_changes(run, memory={"recompute": "none", "offload_activations": False, "dsa_keep_selection": False},
                       train={"indexer_loss": "off"})
    cfg, s = model_config(run), shard_for(run, hw)
    a, T, D = s.a, run.data.seq_len, cfg.hidden_size
    local = T / p.cp
    groups = 1 if p.ep > 1 else gpus // (p.tp * p.cp)
    plan = EvalPlan(run, hw, gpu, gpus, groups)

    split = parameter_split(cfg)
    weights = (split["replicated"] + split["tensor"] / p.tp) * a + split["expert"] / (p.ep * p.etp) * a
    stream_tokens = local / p.tp if p.sequence_parallel and p.tp > 1 else local
    layers = layer_bytes(cfg, s, T, 1)
    biggest = max(layers, key=lambda lay: lay.saved * local + lay.forward_fixed)
    from genome_lm.eval.parallel import HEAD_CHUNK

    vocab, head = cfg.vocab_size / p.tp, min(local, HEAD_CHUNK)
    plan.memory = [
        Item("weights (bf16)" if a == 2 else "weights (fp32)", weights,
             f"{split['replicated'] + split['tensor'] / p.tp + split['expert'] / (p.ep * p.etp):,.0f} parameters"),
        Item("residual streams (a layer's input and output)", 2 * cfg.hc_mult * D * a * stream_tokens,
             f"{cfg.hc_mult} streams x {stream_tokens:,.0f} tokens"),
        Item(f"largest layer's forward ({biggest.kind} + {biggest.mlp}, upper bound)",
             biggest.saved * local + biggest.forward_fixed, f"{local:,.0f} tokens"),
        Item("logits shard and cross-entropy", head * vocab * (a + 4 + 4), f"blocks of {head:,.0f} x {vocab:,.0f}"),
    ]
    if gpu is None:
        return plan

    # time of one window on one group: the training step's parts, forward only
    work = flops.step_work(cfg, run.memory, T=T, batch=1, indexer_loss_mode="off", gpu=True)
    par = parallel_split(p, hw)
    add = plan.time.append
    for w in work:
        add(TimeItem(w.name, w.layer, "compute", compute_seconds(w, w.count * w.forward, par, gpu, c)))
    hbm = gpu.hbm * c.hbm
    add(TimeItem("activations (elementwise)", "", "memory", sum(lay.saved for lay in layers) * local / hbm))
    pairs = selection_pairs(cfg, work)
    if pairs:
        add(TimeItem("DSA selection scores (top-k)", "DSA", "memory",
                     pairs * SCORE_BYTES / par.divisor("queries") / hbm))
    node, every = hw.gpus_per_node, range(cfg.num_hidden_layers)
    shared = selection_share_bytes(cfg, p, run.memory, every, T, 1, "off", 1)
    if shared:
        add(TimeItem("DSA shared selection (pool all-gather)", "DSA", "communication",
                     _group_seconds(shared, 1, p.tp * p.cp, node, gpu, c)))
    if p.tp > 1:
        add(TimeItem("tensor parallel (all-gather, reduce-scatter)", "", "communication",
                     tp_bytes(cfg, p, len(every), local, a) / _link(1, node, gpu, c)))
    if p.cp > 1:
        add(TimeItem("context parallel (head all-to-all, gathers)", "", "communication",
                     _group_seconds(cp_bytes(cfg, p, every, local, T, a), p.tp, p.cp, node, gpu, c)))
    moe_layers = sum(1 for t in cfg.mlp_layer_types if t != "dense")
    if p.ep > 1 and moe_layers:  # dispatch and combine, once each per MoE layer
        add(TimeItem("expert parallel (all-to-all)", "MoE", "communication",
                     2 * moe_layers * all_to_all_seconds(cfg, p, local, a, hw, gpu, c)))
    return plan


def candidate_layouts(run: RunConfig, gpus: int):
    """Layouts of ``gpus`` GPUs for eval: tp and cp powers of two dividing the heads, ep dividing
    the experts, etp 1, sequence parallel with tensor parallel."""
    cfg = model_config(run)
    twos = [1, 2, 4, 8, 16, 32, 64]
    for tp in (t for t in twos if t <= min(gpus, 8)):
        for cp in (x for x in twos if tp * x <= gpus):
            if gpus % (tp * cp) or cfg.linear_num_heads % (tp * cp) or cfg.num_attention_heads % (tp * cp):
                continue
            for ep in (e for e in [1, *twos[1:]] if e <= gpus):
                if gpus % ep or cfg.n_routed_experts % ep:
                    continue
                yield {"tp": tp, "cp": cp, "ep": ep, "etp": 1, "pp": 1, "sequence_parallel": tp > 1}


def smallest_eval_layout(run: RunConfig, hw: Hardware, gpu: GPUSpec | None = None,
                         counts=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> EvalPlan | None:
    """The fewest GPUs (of ``counts``) with a layout whose eval fits, and of those layouts the
    fastest (the lowest peak without ``gpu``); None when none fits."""
    for gpus in counts:
        fitting = []
        for layout in candidate_layouts(run, gpus):
            plan = estimate_eval(with_changes(run, parallel=layout), replace(hw, gpus=gpus), gpu)
            if plan.fits:
                fitting.append(plan)
        if fitting:
            if gpu is None:
                return min(fitting, key=lambda pl: pl.peak)
            return max(fitting, key=lambda pl: pl.tokens_per_s)
    return None


HG38_CHR22 = 50_818_468  # bases of hg38 chr22, N included
HG38_GENOME = 3_088_269_832  # hg38 chr1-22, X and Y, N included


@dataclass(frozen=True)
class ScoreTime:
    """``genome-lm score`` of ``bases`` in windows of the plan's length overlapping by ``context``:
    every base scored once, each window adding ``window - context`` new bases, so the model reads
    ``bases x window / (window - context)`` tokens; with ``embedding_bytes`` per value (2: float16)
    a layer's per-base embeddings take ``bases x hidden_size x embedding_bytes`` on disk."""

    name: str
    bases: int
    tokens: float
    hours: float
    embedding_bytes: float  # one layer, per base


def score_time(plan: EvalPlan, name: str, bases: int, context: int, embedding_bytes: int = 2) -> ScoreTime:
    window = plan.run.data.seq_len
    if not 0 < context < window:
        raise GenomeLMError(f"--score-context {context:,} must be above 0 and below the window ({window:,})")
    tokens = bases * window / (window - context)
    hidden = model_config(plan.run).hidden_size
    return ScoreTime(name, bases, tokens, tokens / plan.tokens_per_s / 3_600, bases * hidden * embedding_bytes)
