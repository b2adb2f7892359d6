"""Bytes that one training step keeps per token, per piece of one decoder layer.

Each function returns bytes per *local* token (a token of this rank's part of the sequence,
``seq_len / cp``) for one piece of the stack, read off the code that runs: which tensors autograd
saves for backward (``saved_*``) and which gradients and buffers exist only while a piece runs
backward (``backward_*``). Widths come from ``ModelConfig`` and the split from ``Shard``; nothing
here knows a model size. ``tests/plan/test_activations.py`` counts the tensors the real tiny
model saves (saved-tensor hooks, deduplicated by storage) and compares them with these sums.

Notation: ``a`` is the activation dtype's size (2 for bf16, 4 for fp32), ``h`` the heads on this
rank. ``fp32_copy(w)`` is the fp32 copy that ``.float()`` makes of a w-wide activation, which is
free when activations are already fp32.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from genome_lm.model.config import ModelConfig
from genome_lm_kernels import KernelBackend, resolve_backend

F32, I64, I32 = 4, 8, 4
KDA_CHUNK = 64  # kernels/genome_lm_kernels/kda/chunked.py CHUNK: one entering state per 64 tokens


@dataclass(frozen=True)
class Shard:
    """How one rank sees the work: dtype size, parallel split, kernel path, indexer loss."""

    a: int = 4  # activation bytes (bf16 2, fp32 4)
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    backend: KernelBackend = field(default_factory=lambda: resolve_backend("torch", "cpu"))  # resolved once
    indexer_loss: bool = True
    moe_imbalance: float = 4.0  # busiest expert-parallel rank's tokens over the mean (ep > 1)
    query_chunk: int | None = None  # memory.dsa_query_chunk
    sp: bool = False  # parallel.sequence_parallel: the residual streams hold 1/tp of the tokens
    gather_token_inputs: bool = True  # parallel.split_dsa_selection: CP gathers the indexer's per-token inputs

    @property
    def stream_tokens(self) -> float:
        """Residual-stream positions (mHC, norms, merges, layer inputs) per local token."""
        return 1 / self.tp if self.sp else 1.0

    def fp32_copy(self, width: float) -> float:
        return 0.0 if self.a == F32 else width * F32

    @property
    def c_kernels(self) -> bool:
        """The backend runs the C kernels of ``genome_lm_kernels/cpu`` (the torch path on a CPU,
        where they are built: ``KernelBackend.native``)."""
        return self.backend.native

    @property
    def gpu_kernels(self) -> bool:
        """The Triton (or fla) kernels, and the DSA layers in absorbed MLA form."""
        return self.backend.gpu


# ------------------------------------------------------------------------------------ pieces
def saved_hyper_connection(cfg: ModelConfig, s: Shard) -> float:
    """One mHC (``common.HyperConnection``): its input streams, the fp32 flattened streams and
    their normalised copy (the linear's input), the mixing logits, the gate sigmoids and the
    Sinkhorn's saved tensors (its input only with the recomputing torch and C paths of
    ``genome_lm_kernels.mhc``; every iteration's quotient and divisor with the reference, autograd
    through the loop)."""
    n, D = cfg.hc_mult, cfg.hidden_size
    if s.backend.name != "reference":
        sinkhorn = n * n * F32
    else:
        sinkhorn = n * n * F32 + (2 * cfg.hc_sinkhorn_iters - 1) * (n * n + n) * F32
    return (n * D * s.a + s.fp32_copy(n * D) + F32 + n * D * F32 + (2 + n) * n * F32 + 3 * n * F32
            + sinkhorn) * s.stream_tokens


def saved_merge(cfg: ModelConfig, s: Shard) -> float:
    """``HyperConnection.merge``: post, block output and comb in the streams' dtype."""
    n = cfg.hc_mult
    return (n + cfg.hidden_size + n * n) * s.a * s.stream_tokens


def saved_rmsnorm(width: int, s: Shard) -> float:
    """``common.RMSNorm``: the input in fp32 (itself, or its fp32 copy), 1/rms, the normalised
    value before the weight."""
    return width * F32 + F32 + width * s.a


def kda_in_c(cfg: ModelConfig, s: Shard) -> bool:
    """Whether KDA runs as the C token recurrence (``genome_lm_kernels/kda/native.py``): a backend
    with the C kernels, and heads small enough."""
    if not s.c_kernels:
        return False
    native_kda = importlib.import_module("genome_lm_kernels.kda.native")
    return native_kda.runs_in_c(cfg.linear_head_dim, cfg.linear_head_dim)


def saved_kda(cfg: ModelConfig, s: Shard) -> float:
    """``model.kda.KDAAttention`` with its kernel (on a CPU the C recurrence for small heads, else
    torch chunked; Triton on GPU)."""
    h, K, D = cfg.linear_num_heads // s.tp, cfg.linear_head_dim, cfg.hidden_size
    V = K
    W = h * K
    projections = D * s.a + K * s.a + W * F32 + W * F32 + h * F32  # x, f_a out, decay logits + sigmoid, beta
    # padded input, conv out; l2norm keeps q, k in fp32: the SiLU output itself when fp32, else
    # fp32 copies of q and k
    conv = 3 * W * F32 * 2 + (3 * W * F32 if s.a == F32 else 2 * W * F32)
    l2norm = 2 * h * F32
    if s.gpu_kernels:  # the Triton function saves its inputs: l2-normalised q, k and g (v, beta shared)
        kernel = 3 * W * F32
    elif kda_in_c(cfg, s):  # kda/native.py: l2-normalised q, k, g, a contiguous fp32 copy of v, and
        kernel = 4 * W * F32 + h * K * V * F32 / KDA_CHUNK  # the state entering every 64 tokens
    else:  # chunked_bwd.ChunkGroup saves q, k, g, W (4K), v, U (2V), beta, M and the UT
        # transform Tinv (2 x 64 per row), and the state entering each chunk (K x V per 64 rows)
        per_head = (4 * K + 2 * V + 1 + 2 * KDA_CHUNK) * F32 + K * V * F32 / KDA_CHUNK
        kernel = h * per_head
    # o fp32, 1/rms, normed, gated, sigmoid, g_a, o_proj in
    output = W * F32 + h * F32 + 3 * W * F32 + K * s.a + W * s.a
    return projections + conv + l2norm + kernel + output


def saved_dsa(cfg: ModelConfig, s: Shard, own_indexer: bool) -> float:
    """``model.dsa.DSAAttention``: MLA projections and norms, the sparse attention's q, k, v, o,
    lse and the selection; the indexer and its loss inputs (over the whole sequence on every
    CP rank, so they count ``cp`` times per local token, except the key norm's, which genome-lm's
    layout computes on the rank's own tokens; the loss's q and k are the attention's)."""
    h = cfg.num_attention_heads // s.tp
    D, Dv = cfg.hidden_size, cfg.v_head_dim
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    slots = cfg.index_topk + cfg.index_kpool - 1
    mla = D * s.a + saved_rmsnorm(rq, s) + rq * s.a + saved_rmsnorm(rkv, s) + rkv * s.a
    attention = saved_sparse_attention(cfg, s) + slots * I32 * s.cp  # the selection's int32 token indices
    if s.cp > 1:
        attention += h * Dv * s.a  # the output back in sequence order
    indexer = 0.0
    if own_indexer and s.indexer_loss:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        # the loss takes the attention's own q and k (this rank's heads, saved above)
        key_norm = Di * s.a + 2 * F32  # the key LayerNorm's input and statistics
        per_token = 2 * Di * F32 + Hi * Di * s.a + Di * F32 / cfg.index_kpool + Hi * F32
        if s.cp > 1 and s.gather_token_inputs:  # keys normed on this rank's tokens, then gathered with q_resid
            indexer = (per_token + rq * s.a) * s.cp + key_norm
        elif s.cp > 1:  # the published layout: the hidden state and q_resid gathered, everything whole
            indexer = (per_token + key_norm + (D + rq) * s.a) * s.cp
        else:
            indexer = per_token + key_norm
    return mla + attention + indexer


def kept_selection(cfg: ModelConfig, s: Shard) -> float:
    """A recomputed DSA layer's token selection, kept as int32 pool ids for the recompute
    (``model.recompute_memo``): topk / kpool per position of the whole sequence."""
    return cfg.index_topk // cfg.index_kpool * 4 * s.cp


def saved_sparse_attention(cfg: ModelConfig, s: Shard) -> float:
    """The sparse attention's saved tensors (its selection, shared with the indexer loss, not
    included). Per head: q, k, v, o and lse; absorbed (GPU kernels): q (the op absorbs it again
    in backward), the latent output (kv_lora_rank wide), lse, and the whole sequence's latent on
    every CP rank."""
    h = cfg.num_attention_heads // s.tp
    if s.gpu_kernels:
        C = cfg.kv_lora_rank
        return (h * cfg.qk_head_dim + h * C) * s.a + h * F32 + C * s.a * s.cp
    return (2 * h * cfg.qk_head_dim + 2 * h * cfg.v_head_dim) * s.a + h * F32


def saved_dense_mlp(cfg: ModelConfig, s: Shard) -> float:
    """megatron-core's ``MLP`` with the clamped SwiGLU: fc1 input and output, clamped gate, its
    SiLU, clamped up, their product (fc2's input)."""
    return cfg.hidden_size * s.a + 6 * (cfg.intermediate_size / s.tp) * s.a


def moe_tokens(s: Shard) -> float:
    """MoE tokens per local token: under TP the MoE runs sequence-parallel (1/tp of them)."""
    return 1 / s.tp


def expert_copies(cfg: ModelConfig, s: Shard) -> float:
    """Routed token copies an expert rank processes per local token: top-k copies, gathered over
    expert-tensor-parallel ranks, times the load imbalance of the busiest expert-parallel rank."""
    imbalance = s.moe_imbalance if s.ep > 1 else 1.0
    return moe_tokens(s) * cfg.num_experts_per_tok * s.etp * imbalance


def saved_moe(cfg: ModelConfig, s: Shard) -> float:
    """megatron-core's ``MoELayer``: input, router (fp32 logits, top-k, routing map, probs), the
    shared expert (an MLP), and per routed copy the permuted input, the expert's SwiGLU
    activations and its probability."""
    D, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    I, Is = cfg.moe_intermediate_size / s.etp, cfg.shared_expert_size / s.tp
    router = E * F32 + k * I64 + F32 + k * F32 + k * I64 + E + E * F32
    shared = 6 * Is * s.a
    per_copy = D * s.a + 7 * I * s.a + F32
    # the shared expert runs on the whole local sequence (its linears gather the sequence-parallel
    # slices and save only their own slice)
    # under TP the sequence-parallel slice of the input is held twice (the scattered slice and
    # the copy the MoE layer routes), unless the streams are sequence-parallel already
    inputs = D * s.a * (2 if s.tp > 1 and not s.sp else 1)
    return (inputs + router) * moe_tokens(s) + shared + per_copy * expert_copies(cfg, s)


def moe_dispatch(cfg: ModelConfig, s: Shard, chunks: int) -> float:
    """The token dispatcher's buffers while an MoE layer runs forward (not saved): the permuted
    copies sent to the experts and the expert outputs on their way back, for one of ``chunks``
    chunks of the tokens."""
    return 2 * expert_copies(cfg, s) * cfg.hidden_size * s.a / chunks


def saved_head(cfg: ModelConfig, s: Shard) -> float:
    """Final norm, output layer input and the cross-entropy's fp32 softmax over this rank's
    vocabulary shard."""
    D = cfg.hidden_size
    return saved_rmsnorm(D, s) * s.stream_tokens + D * s.a + cfg.vocab_size / s.tp * F32 + I64 + F32


def head_transient(cfg: ModelConfig, s: Shard) -> float:
    """Logits, their fp32 copy and their gradient, alive around the loss."""
    V = cfg.vocab_size / s.tp
    return V * s.a + s.fp32_copy(V) + V * F32


def layer_input(cfg: ModelConfig, s: Shard) -> float:
    """What full recompute keeps of a layer: its input streams."""
    return cfg.hc_mult * cfg.hidden_size * s.a * s.stream_tokens


# --------------------------------------------------------------------------- backward buffers
def backward_attention(cfg: ModelConfig, s: Shard, kda: bool) -> float:
    """Gradient buffers of the attention kernels while they run backward."""
    if kda:
        h, K = cfg.linear_num_heads // s.tp, cfg.linear_head_dim
        W = h * K
        if s.gpu_kernels:  # the Triton backward's buffers (the kernel module's own inventory), d(conv input)
            triton = importlib.import_module("genome_lm_kernels.kda.triton")
            return h * triton.backward_bytes_per_token(K, K, exact=s.backend.exact) + 3 * W * F32
        if kda_in_c(cfg, s):  # dq, dk, dv, dg, dbeta written directly, d(conv input)
            return 4 * W * F32 + h * F32 + 3 * W * F32
        # dq, dk, dv, dg in the chunk layout and their padded copies, d(conv input)
        return 8 * W * F32 + 3 * W * F32
    h = cfg.num_attention_heads // s.tp
    Dqk, Dv = cfg.qk_head_dim, cfg.v_head_dim
    if s.gpu_kernels:  # absorbed: dq (latent width) and the whole sequence's dkv fp32, delta
        C = cfg.kv_lora_rank
        grads = h * C * F32 + C * F32 * s.cp + h * F32
    else:
        grads = h * (2 * Dqk + Dv) * F32 + h * F32  # dq, dk, dv fp32 accumulators, delta
    if s.indexer_loss:
        grads += (cfg.index_n_heads * (cfg.index_head_dim + 1) + cfg.index_head_dim) * F32 * s.cp
    return grads


def backward_mlp(cfg: ModelConfig, s: Shard, moe: bool) -> float:
    """The MLP's gradient buffers beside everything the layer saved. Dense: fc2's input gradient,
    then the gate's and up's (the SwiGLU's saved product is freed once fc2's backward has used it,
    so two intermediate-wide buffers net)."""
    if not moe:
        return 2 * (cfg.intermediate_size / s.tp) * s.a
    return 3 * (cfg.moe_intermediate_size / s.etp) * s.a * expert_copies(cfg, s)


def backward_streams(cfg: ModelConfig, s: Shard) -> float:
    """Gradients of the streams flowing through a layer (in, out, and torch's product through the
    mHC merge, which the C merge of the CPU path does not make) and the mHC's fp32 flattened
    gradient."""
    n, D = cfg.hc_mult, cfg.hidden_size
    copies = 2 if mhc_in_c(s) else 3
    return (copies * n * D * s.a + 2 * n * D * F32) * s.stream_tokens


def mhc_in_c(s: Shard) -> bool:
    """Whether mHC's collapse and merge run in C (``genome_lm_kernels.mhc.native``): fp32 streams with a
    backend that runs the C kernels."""
    return s.c_kernels and s.a == F32


DSA_DEFAULT_CHUNK = 64  # model.dsa.DSAAttention.query_chunk unless memory.dsa_query_chunk sets it


def backward_fixed(cfg: ModelConfig, s: Shard, kda: bool) -> float:
    """Bytes of the torch kernels' working blocks, whatever the length: KDA prepares ``GROUP``
    chunks at a time (and its backward forms their pairwise gradients a group at a time), the
    pairwise decays being the largest temporaries; DSA scores blocks of queries whose gathered keys hold at most
    ``GATHER_ELEMENTS`` values (keys, values and two products of that size in backward). The
    Triton kernels keep theirs in on-chip memory."""
    if s.backend.name != "torch":
        return 0.0
    if kda and kda_in_c(cfg, s):  # per thread one block of 64 tokens' states (78 KB at 16 x 16 heads)
        return 0.0
    if kda:
        chunked = importlib.import_module("genome_lm_kernels.kda.chunked")
        rows = chunked.GROUP * chunked.CHUNK  # (token, head) rows of one group
        K, nsub = cfg.linear_head_dim, chunked.CHUNK // chunked.SUB
        return rows * (2 * chunked.CHUNK + 3 * nsub * K + 4 * K) * F32
    sparse = importlib.import_module("genome_lm_kernels.dsa.sparse_attention")
    h = cfg.num_attention_heads // (s.tp * s.cp)
    slots = cfg.index_topk + cfg.index_kpool - 1
    width = max(cfg.qk_head_dim, cfg.v_head_dim)
    queries = sparse.queries_per_block(DSA_DEFAULT_CHUNK if s.query_chunk is None else s.query_chunk,
                                       slots, h, width)
    return 4 * queries * slots * h * width * F32


def indexer_blocks(cfg: ModelConfig, s: Shard, seq_len: int, batch: int) -> tuple[float, float, float]:
    """(selection, loss forward, loss backward) bytes of one query block of the DSA indexer (both backends run these
    in torch), over the whole sequence on every CP rank, ``query_chunk`` queries at a time:

    - forward, selection (``kernels/genome_lm_kernels/dsa/indexer.py``): the [chunk, T / kpool] fp32 pool
      scores and one head's scores being added in, 8 bytes per query and pool, with the
      visibility mask of the pools that end inside the block (2 bytes each); and for the
      queries whose top-k is tied (``pick_pools``), ``TIED_ROWS`` of them at a time, a copy of
      their scores, four bool masks and two int64 tensors, 28 bytes per pool;
    - forward and backward, the sparse indexer loss (``kernels/genome_lm_kernels/dsa/loss.py``): per query its
      candidate pool keys [topk / kpool, Di] and the [Hi, topk / kpool] scores with their ReLU
      and weighting, fp32; backward holds their gradients as well.
    """
    chunk = DSA_DEFAULT_CHUNK if s.query_chunk is None else s.query_chunk
    chunk = min(chunk, seq_len)
    pools = seq_len // cfg.index_kpool
    tied_rows = importlib.import_module("genome_lm_kernels.dsa.indexer").TIED_ROWS
    # the visibility mask of the block's last pools (a comparison and its negation, bool)
    mask = chunk * min(pools, -(-chunk // cfg.index_kpool)) * 2
    selection = chunk * pools * 2 * F32 + mask + min(chunk, tied_rows) * pools * (F32 + 4 + 2 * I64)
    loss = 0.0
    if s.indexer_loss:
        M = min(cfg.index_topk // cfg.index_kpool, pools)
        loss = chunk * (M * cfg.index_head_dim + 3 * cfg.index_n_heads * M + cfg.index_topk) * F32
    return batch * selection, batch * loss, batch * 2 * loss
