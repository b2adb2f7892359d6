"""Floating-point operations of one training step, from the config: the one FLOP count behind
``genome-lm plan``'s time model and the trainer's logged TFLOP/s and MFU.

    work = step_work(cfg, memory, T=..., batch=..., indexer_loss=..., gpu=...)

Each ``Work`` item is one piece of one layer (or of the head) for one micro-batch of ``batch``
sequences of ``T`` tokens, counted the way the code computes it: matrix products as 2 x m x n x k
("matmul": BLAS on a CPU, tensor cores on a GPU) and the attention work that the CPU path does
with gathered broadcast products ("vector": the same arithmetic, but not a matrix product there).
Per piece: ``forward``, ``backward`` (the gradients, plus what the op's own backward recomputes,
such as KDA's checkpointed chunk preparation) and ``replay`` (a forward run again in backward
under ``memory.recompute`` or ``memory.moe_chunk_recompute``). The rules, per piece:

- a linear layer: forward 2 N in out; backward twice that (input and weight gradients), once
  for the DSA indexer's projections (their inputs are detached: weight gradients only) and none
  when the indexer loss is off (then nothing of the indexer needs a gradient);
- KDA: the chunked algorithm of ``genome_lm_kernels.kda.chunked`` per 64-token chunk (the
  sub-chunk pairwise products, the blocked unit-lower inverse, W and U, the chunk transitions,
  the state loop and the outputs); its backward recomputes the checkpointed preparation;
- DSA selection (``select_tokens``): every query block scored against every pool complete by
  the block's end, 2 Hi Di per query-pool pair, O(T^2 / kpool); forward only, and not replayed
  when ``dsa_keep_selection`` keeps it for the recompute;
- sparse attention: on the CPU path, blocks of queries that see at most 8 S keys are scored
  densely with matrix products and longer ones gather their S slots (vector work); on a GPU
  every query attends over its S slots on tensor cores, over the 512-wide MLA latent (absorbed);
- the indexer loss: its target (main attention over all visible keys in dense mode, over the
  selected ones in sparse mode) and its scores; backward recomputes the scores, and the target
  too when the targets exceed ``KEEP_TARGET_BYTES``;
- MoE: router, shared expert and ``num_experts_per_tok`` routed copies per token; mHC's stream
  projection and merge; the output layer (recomputed in backward with ``memory.loss_chunk``).

Elementwise work (norms, softmax, gates, the Sinkhorn steps, the short convolution) is left
out: it is memory-bound, and ``plan.time_model`` charges it by bytes, not FLOPs.

``split`` says how a piece divides over the GPUs of one model replica (``per_gpu``): "heads"
over tp x cp (heads or vocabulary over tensor parallel, tokens or heads over context parallel),
"tokens" over cp only (the low-rank projections every tensor-parallel rank runs on the gathered
sequence), "streams" over tp x cp with sequence parallel (mHC, norms) else cp, "whole" on every
rank (the DSA indexer's projections run on the whole gathered sequence on each), "queries" over
tp x cp when the DSA selection and its loss's scores are shared out by query blocks
(``parallel.split_dsa_selection``), else whole on every rank, "experts" the busiest expert
rank: tp x cp's share times the MoE imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from genome_lm.model.config import DENSE, FULL, LINEAR, ModelConfig
from genome_lm_kernels.dsa.loss import KEEP_TARGET_BYTES, _n_candidates, _target_bytes
from genome_lm_kernels.dsa.reference import slot_width
from genome_lm_kernels.dsa.sparse_attention import DENSE_KEYS_PER_SLOT, queries_per_block
from genome_lm_kernels.kda.chunked import CHUNK as KDA_CHUNK
from genome_lm_kernels.kda.chunked import SUB as KDA_SUB

DSA_CHUNK = 64  # the DSA kernels' default query block (memory.dsa_query_chunk overrides)


@dataclass(frozen=True)
class Work:
    """FLOPs of one piece for one micro-batch (the whole sequence, before any parallel split)."""

    name: str  # e.g. "KDA projections"
    layer: str  # what the time split groups by: "KDA", "DSA", "dense MLP", "MoE", "mHC", "head"
    forward: float = 0.0
    backward: float = 0.0
    replay: float = 0.0  # forward run again under recompute
    kind: str = "matmul"  # "matmul" or "vector" (gathered attention on the CPU path)
    split: str = "heads"  # "heads", "tokens", "streams", "whole", "queries" or "experts" (module docstring)
    count: int = 1  # layers of this kind (pieces of identical layers are summed into one item)

    @property
    def total(self) -> float:
        return self.count * (self.forward + self.backward + self.replay)


@dataclass(frozen=True)
class Parallel:
    """How one model replica is split (``per_gpu``)."""

    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    moe_imbalance: float = 1.0  # busiest expert rank's load over the mean
    share_queries: bool = False  # the DSA selection and indexer-loss scores shared out over tp x cp

    def divisor(self, split: str) -> float:
        if split == "heads":
            return self.tp * self.cp
        if split == "tokens":
            return self.cp
        if split == "streams":
            return self.tp * self.cp if self.sequence_parallel else self.cp
        if split == "whole":
            return 1
        if split == "queries":
            return self.tp * self.cp if self.share_queries else 1
        if split == "experts":
            return self.tp * self.cp / self.moe_imbalance
        raise ValueError(f"unknown split {split!r}")


def per_gpu(work: list[Work], parallel: Parallel) -> float:
    """FLOPs one GPU runs for these pieces (the busiest expert rank for the experts)."""
    return sum(w.total / parallel.divisor(w.split) for w in work)


def total(work: list[Work], kind: str | None = None) -> float:
    """FLOPs of the pieces over the whole model replica (of one ``kind`` when given)."""
    return sum(w.total for w in work if kind is None or w.kind == kind)


# ------------------------------------------------------------------------------- pieces
def _linear(name: str, layer: str, n: int, shapes: list[tuple[int, int]], *, grad: float = 2.0,
            split: str = "heads") -> Work:
    """Linear layers on n tokens, (in, out) each; ``grad``: backward as a multiple of forward."""
    fwd = sum(2.0 * n * a * b for a, b in shapes)
    return Work(name, layer, fwd, grad * fwd, split=split)


def _inverse_flops(C: int, sub: int) -> float:
    """The blocked unit-lower inverse of one C x C chunk matrix (``_UnitLowerInverse.forward``):
    the sub x sub diagonal blocks by forward substitution, then each block row b from the rows
    above (two products)."""
    diag = (C // sub) * sum(2 * i * i for i in range(1, sub))
    rows = sum(2 * sub * (b * sub) ** 2 + 2 * sub * sub * b * sub for b in range(1, C // sub))
    return float(diag + rows)


def kda_core(cfg: ModelConfig, T: int, batch: int) -> Work:
    """The chunked KDA recurrence (``kda_chunked``), all heads, forward and backward."""
    C, sub, K, V = KDA_CHUNK, KDA_SUB, cfg.linear_head_dim, cfg.linear_head_dim
    chunks = batch * cfg.linear_num_heads * -(-T // C)
    pairwise = 4.0 * C * C * K  # P_kk and M, each sub-chunk's rows against the whole chunk
    wu = 2.0 * C * C * (K + V)  # W = Tinv (beta e^G k), U = Tinv (beta v)
    prepare = pairwise + _inverse_flops(C, sub) + wu
    # T_c = diag - Kd^T W, b_c = Kd^T U, the state loop (one baddbmm), o = Qg S + M (U - W S)
    rest = 2.0 * C * K * K + 2.0 * C * K * V + 2.0 * K * K * V + 4.0 * C * K * V + 2.0 * C * C * V
    # backward (chunked_bwd, nothing recomputed): the output's and the state loop's gradients
    # (4CCV + 14CKV + 2CKK + 2KKV), W's and U's (2 wu), and the pairwise products' gradients,
    # each sub-chunk's rows against the columns up to its end (4 C K (C + sub))
    backward = (4.0 * C * C * V + 14.0 * C * K * V + 2.0 * C * K * K + 2.0 * K * K * V + 2 * wu
                + 4.0 * C * K * (C + sub))
    return Work("KDA recurrence", "KDA", chunks * (prepare + rest), chunks * backward)


def _query_blocks(T: int, chunk: int):
    for t0 in range(0, T, chunk):
        yield t0, min(t0 + chunk, T)


def dsa_selection(cfg: ModelConfig, T: int, batch: int, chunk: int) -> Work:
    """``select_tokens``: each query block against every pool complete by its end (no gradient)."""
    kpool, Hi, Di = cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    N = T // kpool
    pairs = sum((t1 - t0) * min(N, t1 // kpool) for t0, t1 in _query_blocks(T, chunk))
    return Work("DSA indexer selection", "DSA", 2.0 * batch * pairs * Hi * Di, split="queries")


def sparse_attention(cfg: ModelConfig, T: int, batch: int, chunk: int, gpu: bool) -> list[Work]:
    """The main attention over each query's S = index_topk + kpool - 1 selected slots."""
    H, Dqk, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    S = slot_width(cfg.index_topk, cfg.index_kpool)
    if gpu:  # absorbed MLA: q W_UK, scores and values over the latent, then W_UV (sparse_mla)
        L = cfg.kv_lora_rank
        per_query = 2.0 * H * S * (L + L)
        absorb = 2.0 * H * (Dqk * L + L * Dv)
        # backward: the scores again, dP, dq, dkv (x2: keys and values share the latent), and
        # q W_UK formed again with its two gradients, W_UV's two gradients
        fwd = batch * T * (per_query + absorb)
        bwd = batch * T * (2.0 * H * S * (3 * L + 2 * L) + 2.0 * H * Dqk * L * 3 + 2.0 * 2 * H * L * Dv)
        return [Work("DSA sparse attention", "DSA", fwd, bwd)]
    C = queries_per_block(chunk, S, H, max(Dqk, Dv))
    dense_keys = gathered = 0
    for t0, t1 in _query_blocks(T, C):
        if t1 <= DENSE_KEYS_PER_SLOT * S:
            dense_keys += (t1 - t0) * t1  # query-key pairs scored with matrix products
        else:
            gathered += (t1 - t0) * S
    out = []
    for name, pairs, kind in (("DSA sparse attention (dense blocks)", dense_keys, "matmul"),
                              ("DSA sparse attention (gathered)", gathered, "vector")):
        if pairs:  # forward q k^T and p v; backward s again, dp, dq, dk, dv
            out.append(Work(name, "DSA", 2.0 * batch * H * pairs * (Dqk + Dv),
                            2.0 * batch * H * pairs * (3 * Dqk + 2 * Dv), kind=kind))
    return out


def indexer_loss(cfg: ModelConfig, T: int, batch: int, chunk: int, mode: str, gpu: bool) -> list[Work]:
    """The indexer's KL loss (``genome_lm_kernels.dsa.loss``): target and scores per query block."""
    kpool, Hi, Di, H = cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim, cfg.num_attention_heads
    Dqk = cfg.kv_lora_rank if gpu else cfg.qk_nope_head_dim  # absorbed: q W_UK against the latent
    N, sparse = T // kpool, mode == "sparse"
    S = slot_width(cfg.index_topk, kpool) if sparse else None  # None: dense mode, every visible pool
    target = scores = 0.0
    for t0, t1 in _query_blocks(T, chunk):
        c = t1 - t0
        target += c * (S if sparse else t1)  # query-key pairs of the main attention
        scores += c * _n_candidates(t1, kpool, N, S)  # query-pool pairs of the indexer
    kept = _target_bytes(batch, T, N, S, kpool, chunk, 4) <= KEEP_TARGET_BYTES  # fp32 targets
    target_fwd = 2.0 * batch * H * target * Dqk
    score_fwd = 2.0 * batch * scores * Hi * Di
    absorb = 2.0 * batch * T * H * cfg.qk_nope_head_dim * cfg.kv_lora_rank if gpu else 0.0
    # the target has no gradient: backward computes it again unless kept
    out = [Work("DSA indexer loss target", "DSA", target_fwd + absorb, 0.0 if kept else target_fwd + absorb,
                kind="vector" if sparse and not gpu else "matmul")]
    # the scores: backward recomputes them and takes both gradients
    out.append(Work("DSA indexer loss scores", "DSA", score_fwd, 3 * score_fwd, split="queries"))
    return out


# ------------------------------------------------------------------------------- the step
def layer_work(cfg: ModelConfig, i: int, T: int, batch: int, *, indexer_loss_mode: str = "off",
               chunk: int | None = None, gpu: bool = False) -> list[Work]:
    """The pieces of layer ``i`` (forward and backward, no recompute) for one micro-batch."""
    n = batch * T
    D, nh = cfg.hidden_size, cfg.hc_mult
    chunk = chunk or DSA_CHUNK
    # two hyper-connections: the stream projection [n D] -> [(2 + n) n] and the merge comb^T @ streams
    hc = 2 * (2.0 * n * nh * D * (2 + nh) * nh + 2.0 * n * nh * nh * D)
    work = [Work("mHC", "mHC", hc, 2 * hc, split="streams")]
    if cfg.layer_types[i] == LINEAR:
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        W = H * K
        work.append(_linear("KDA projections", "KDA", n, [(D, W)] * 3 + [(K, W)] * 2 + [(D, H), (W, D)]))
        work.append(_linear("KDA low-rank projections", "KDA", n, [(D, K)] * 2, split="tokens"))
        work.append(kda_core(cfg, T, batch))
    else:
        H, rq, rkv = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        work.append(_linear("MLA projections", "DSA", n, [(rq, H * cfg.qk_head_dim),
                                                         (rkv, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                                                         (H * cfg.v_head_dim, D)]))
        work.append(_linear("MLA low-rank projections", "DSA", n, [(D, rq), (D, rkv)], split="tokens"))
        if cfg.indexer_types[i] == FULL:
            Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            grad = 1.0 if indexer_loss_mode != "off" else 0.0  # detached inputs: weight gradients only
            work.append(_linear("DSA indexer projections", "DSA", n, [(rq, Hi * Di), (D, Di), (D, Hi), (D, Di)],
                                grad=grad, split="whole"))
            work.append(dsa_selection(cfg, T, batch, chunk))
            if indexer_loss_mode != "off":
                work += indexer_loss(cfg, T, batch, chunk, indexer_loss_mode, gpu)
        work += sparse_attention(cfg, T, batch, chunk, gpu)
    if cfg.mlp_layer_types[i] == DENSE:
        work.append(_linear("dense MLP", "dense MLP", n, [(D, 2 * cfg.intermediate_size), (cfg.intermediate_size, D)]))
    else:
        I, E = cfg.moe_intermediate_size, cfg.n_routed_experts
        # under tensor parallel the MoE always runs sequence-parallel: each rank routes 1 / tp of the tokens
        work.append(_linear("MoE router", "MoE", n, [(D, E)]))
        work.append(_linear("MoE shared expert", "MoE", n, [(D, 2 * cfg.shared_expert_size),
                                                            (cfg.shared_expert_size, D)]))
        routed = n * cfg.num_experts_per_tok
        work.append(_linear("MoE routed experts", "MoE", routed, [(D, 2 * I), (I, D)], split="experts"))
    return work


def head_work(cfg: ModelConfig, T: int, batch: int, loss_chunk: int | None) -> Work:
    """The output layer over the vocabulary; in loss blocks its logits are recomputed in backward."""
    fwd = 2.0 * batch * T * cfg.hidden_size * cfg.vocab_size
    return Work("output layer", "head", fwd, 2 * fwd, fwd if loss_chunk and loss_chunk < T else 0.0)


def with_recompute(work: list[Work], memory, moe: bool, merge: float = 0.0) -> list[Work]:
    """Add what ``memory``'s recompute replays in backward to one layer's pieces: the whole
    forward under full recompute (the DSA selection only without ``dsa_keep_selection``), the
    attention and MLP blocks once more under nested recompute, the chosen modules under
    selective recompute, the MoE layer under ``moe_chunk_recompute``. ``merge``: the FLOPs of
    one mHC merge product, which a full recompute does not replay (below)."""
    full, nested = memory.recompute == "full", memory.recompute == "full" and memory.recompute_nested
    modules = memory.recompute_modules if memory.recompute == "selective" else []
    # MoE chunks checkpointed inside an already checkpointed MoE block replay nothing more
    moe_block_checkpointed = nested or "moe" in modules
    chunks_replayed = moe and memory.moe_chunk_recompute and memory.moe_chunks > 1 and not moe_block_checkpointed
    out = []
    for w in work:
        attention = w.layer in ("KDA", "DSA")
        mlp = w.layer in ("dense MLP", "MoE")
        if full:
            times = 1 + int(nested and (attention or mlp))
        else:
            times = int((attention and "attention" in modules) or (w.layer == "dense MLP" and "mlp" in modules)
                        or (w.layer == "MoE" and "moe" in modules))
        if w.name == "DSA indexer selection" and memory.dsa_keep_selection:
            times = 0
        if chunks_replayed and w.layer == "MoE":
            times += 1  # each chunk's whole MoE forward: router, shared and routed experts
        replay = times * w.forward
        if w.name == "mHC" and full:
            # torch's non-reentrant checkpoint stops replaying once every saved tensor is back:
            # the layer's last product (the MLP merge's comb^T @ streams) saves nothing and is skipped
            replay -= merge
        out.append(replace(w, replay=w.replay + replay) if replay else w)
    return out


def step_work(cfg: ModelConfig, memory, *, T: int, batch: int = 1, indexer_loss_mode: str = "off",
              gpu: bool = False, layers: range | None = None, head: bool = True) -> list[Work]:
    """Every piece of one micro-batch's forward and backward under ``memory``'s switches (a
    ``MemoryConfig``): identical layers' pieces summed into one item each (``count``), the
    output layer last (when ``head``). ``layers``: a pipeline stage's (all by default)."""
    chunk = memory.dsa_query_chunk or DSA_CHUNK
    merge = 2.0 * batch * T * cfg.hc_mult**2 * cfg.hidden_size
    items: dict[tuple, Work] = {}
    kinds: dict[tuple, list[Work]] = {}  # layers of one kind have the same pieces: computed once
    for i in layers if layers is not None else range(cfg.num_hidden_layers):
        kind = cfg.layer_kind(i)
        if kind not in kinds:
            pieces = layer_work(cfg, i, T, batch, indexer_loss_mode=indexer_loss_mode, chunk=chunk, gpu=gpu)
            kinds[kind] = with_recompute(pieces, memory, cfg.mlp_layer_types[i] != DENSE, merge)
        for w in kinds[kind]:
            key = (w.name, w.layer, w.forward, w.backward, w.replay, w.kind, w.split)
            items[key] = replace(items[key], count=items[key].count + 1) if key in items else w
    out = list(items.values())
    if head:
        out.append(head_work(cfg, T, batch, memory.loss_chunk))
    return out


def model_flops_per_token(cfg: ModelConfig) -> float:
    """6 x active parameters per token (forward + backward of every matrix a token passes
    through): the conventional "model FLOPs" of an MoE, without attention and recompute."""
    D = cfg.hidden_size
    active = 0.0
    for i in range(cfg.num_hidden_layers):
        for w in layer_work(cfg, i, 1, 1, indexer_loss_mode="off"):
            if w.name in ("KDA projections", "KDA low-rank projections", "MLA projections",
                          "MLA low-rank projections", "dense MLP", "MoE router", "MoE shared expert",
                          "MoE routed experts"):
                active += w.forward / 2
    active += D * cfg.vocab_size
    return 6.0 * active


def model_flops(cfg: ModelConfig, memory, *, T: int, batch: int = 1, indexer_loss_mode: str = "off",
                gpu: bool = False) -> float:
    """Forward + backward FLOPs of one micro-batch, without what recompute replays (the ops' own
    backward recomputation, such as KDA's, is part of their backward): what TFLOP/s and MFU
    count, as Megatron-LM's ``num_floating_point_operations`` does."""
    work = step_work(cfg, memory, T=T, batch=batch, indexer_loss_mode=indexer_loss_mode, gpu=gpu)
    return sum(w.count * (w.forward + w.backward) for w in work)
