"""The DSA layer of GLM-5.3-Flash: MLA without positional encoding + the k-pool lightning indexer.

(glm5_next ``Glm5NextTextAttention`` and ``Glm5NextTextIndexer``.) The indexer picks, for each
query, the top ``index_topk / index_kpool`` complete pools of ``index_kpool`` tokens plus the
query's incomplete tail pool; the main attention then runs over those tokens only
(``genome_lm_kernels.dsa.sparse_attention``: gathered keys, chunked queries, memory O(T * topk)).
A layer whose ``indexer_types`` entry is "shared" has no indexer and reuses the selection of the
previous full layer.

Training adds the indexer loss (DeepSeek-V3.2): KL between the main attention distribution
(summed over heads, normalised) and the indexer's distribution, on a detached indexer input so
the loss trains only the indexer and the language-model loss never reaches it. Mode "dense"
(warm-up, all visible pools) or "sparse" (the selected pools).

Tensor parallel splits the attention heads (q_b, kv_b column-parallel, o row-parallel); the
low-rank down projections, their norms and the indexer are replicated. The indexer loss's
target sums the attention over every head: each rank sums its own heads' part per query block
and an all-reduce over the tensor- and context-parallel groups adds the others' (a [block,
topk / kpool] fp32 block per call), so no rank holds another rank's q and k.

Context parallel (``genome_lm.engine.context_parallel``): x holds this rank's zigzag tokens. The
projections run on them; q, k, v go through a head-wise all-to-all so that attention runs over
the whole sequence for heads / cp of the heads, and back. The indexer needs every key: each
rank computes its tokens' indexer keys, head weights and gate logits (from the detached hidden
state) and gathers them over CP, with their gradients going back to their owners, and gathers
the (detached, low-rank) q_resid for the indexer queries, so that every rank of the TP x CP
group holds the same indexer inputs for the whole sequence.

The selection and the indexer loss are shared out over that group (``parallel.split_dsa_selection``,
the default; ``share_group``): each rank selects for its blocks of queries
(``engine.query_share``: an early run of blocks with a late one) and the group all-gathers the
int32 pool ids, so every rank attends with the whole sequence's selection, the one-process one
bit for bit. For the loss every rank still sums its own heads' attention over every query block
(its part of the target), the block's owner receives the sum and computes that block's KL term.
A rank's loss is then its blocks' share; the value returned is the group's sum divided by cp
(what each CP rank returned before), its gradient the share's own. The indexer's parameters get
a partial gradient on each TP rank, so they are marked ``sequence_parallel``: the training step
sums them over TP (``train.optim.allreduce_sequence_parallel_grads``) and data-parallel reduction
sums them over CP, which gives the single-process gradient. With the switch off every
rank gathers the hidden state over CP, selects for the whole sequence and computes the loss for
every query (divided by cp), as the published run's layout does.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import nn

from genome_lm.engine.context_parallel import (
    gather_sequence,
    gather_sequence_with_grad,
    group_size,
    head_slice,
    heads_per_rank,
    heads_to_seq,
    seq_to_heads,
)
from genome_lm.engine.query_share import QueryShare, summed_over
from genome_lm_kernels import dsa as dsa_ops

from . import recompute_memo
from .common import (
    AttentionSubmodules,
    BuildOptions,
    RMSNorm,
    attention_submodules,
    column_linear,
    replicated_linear,
    row_linear,
    tp_shared,
)
from .config import SHARED, ModelConfig

IndexerLossMode = Literal["off", "dense", "sparse"]


class DSAOutput(NamedTuple):
    out: torch.Tensor  # [S, B, hidden]
    idx: torch.Tensor  # [B, T, index_topk + index_kpool - 1] selected tokens of the whole sequence, -1 = empty
    indexer_loss: torch.Tensor | None


class Indexer(nn.Module):
    """The lightning indexer's parameters and its inputs for the kernels (replicated under TP)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        self.heads, self.dim = Hi, Di
        self.wq_b = replicated_linear(cfg.q_lora_rank, Hi * Di, cfg, dtype)
        self.wk = replicated_linear(cfg.hidden_size, Di, cfg, dtype)
        self.k_norm = nn.LayerNorm(Di, eps=1e-6, dtype=dtype)
        self.weights_proj = replicated_linear(cfg.hidden_size, Hi, cfg, dtype)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(cfg.index_kpool, Di, dtype=dtype))
        self.index_kpool_compress_gate = nn.Parameter(torch.ones(Di, cfg.hidden_size, dtype=dtype))

    def inputs(self, x_BSD: torch.Tensor, q_resid_BSR: torch.Tensor):
        """(q [B,S,Hi,Di], k [B,S,Di], w [B,S,Hi], gate logits [B,S,Di]) as glm5_next computes them."""
        return (self.queries(q_resid_BSR), *self.token_inputs(x_BSD))

    def queries(self, q_resid_BSR: torch.Tensor) -> torch.Tensor:
        return self.wq_b(q_resid_BSR).unflatten(-1, (self.heads, self.dim))

    def token_inputs(self, x_BSD: torch.Tensor):
        """(k [B,S,Di], w [B,S,Hi], gate logits [B,S,Di]): per token, from the hidden state alone."""
        k = self.k_norm(self.wk(x_BSD))
        w = self.weights_proj(x_BSD).float() * self.heads**-0.5
        gate = x_BSD @ self.index_kpool_compress_gate.t()
        return k, w, gate


class DSAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tf_config, options: BuildOptions, tp_group, cp_group=None,
                 submodules: AttentionSubmodules | None = None, tp_cp_group=None):
        super().__init__()
        if submodules is None:  # built directly, not from a spec: the options' spec provider
            submodules = attention_submodules(options.spec_provider())
        tp = group_size(tp_group)
        heads_per_rank(cfg.num_attention_heads, tp, group_size(cp_group), "num_attention_heads")
        self.cfg, self.backend, self.tp_group, self.cp_group = cfg, options.kernel_backend, tp_group, cp_group
        # queries per block in the indexer, the sparse attention and the indexer loss (memory.dsa_query_chunk)
        self.query_chunk = 64
        # a recomputed forward replays the forward's selection (memory.dsa_keep_selection)
        self.keep_selection = True
        self.absorbed = options.absorbed_mla  # attention over the shared latent (see _absorbed)
        self.heads = cfg.num_attention_heads // tp
        self.scale = cfg.qk_head_dim**-0.5
        dtype = options.dtype
        H = cfg.num_attention_heads

        def column(n_in: int, n_out: int):
            return column_linear(submodules.linear_column, tf_config, tp_group, n_in, n_out)

        self.q_a_proj = replicated_linear(cfg.hidden_size, cfg.q_lora_rank, cfg, dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.q_b_proj = column(cfg.q_lora_rank, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = replicated_linear(cfg.hidden_size, cfg.kv_lora_rank, cfg, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = column(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = row_linear(submodules.linear_row, tf_config, tp_group, H * cfg.v_head_dim, cfg.hidden_size)
        self.indexer = None if cfg.indexer_types[layer_idx] == SHARED else Indexer(cfg, dtype)
        # genome-lm's layout (parallel.split_dsa_selection) gathers the indexer's per-token inputs
        # over CP, not the hidden state, and shares the selection and the loss out over TP x CP
        self.gather_token_inputs = options.split_dsa_selection
        # the group the selection and the indexer loss are shared out over (TP x CP), or None
        self.share_group = tp_cp_group if options.split_dsa_selection and group_size(tp_cp_group) > 1 else None
        if self.share_group is not None and tp > 1 and self.indexer is not None:
            for p in self.indexer.parameters():  # each TP rank's gradient covers its queries only
                p.sequence_parallel = True

    def forward(self, x: torch.Tensor, shared_idx: torch.Tensor | None = None,
                indexer_loss: IndexerLossMode = "off", indexer_tokens: int | None = None) -> DSAOutput:
        """x [S, B, hidden] (S: this CP rank's tokens); ``shared_idx`` is the previous full layer's
        selection for a shared layer. The indexer loss covers the first ``indexer_tokens`` positions
        of the whole sequence (all when None): the trainer pads sequences for context parallel,
        and causality makes the loss of the leading positions independent of the padding."""
        S, B, _ = x.shape
        cfg, cp = self.cfg, self.cp_group
        x_BSD = x.transpose(0, 1)
        q_resid = self.q_a_layernorm(self.q_a_proj(x_BSD))
        q = self.q_b_proj(q_resid.transpose(0, 1))[0].transpose(0, 1).unflatten(-1, (self.heads, cfg.qk_head_dim))
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x_BSD))

        loss = None
        if self.indexer is None:
            if shared_idx is None:
                raise ValueError("a shared DSA layer needs the selection of a previous full layer")
            idx = shared_idx
        else:
            # the indexer sees a detached input: its loss trains it alone, the LM loss never does.
            # Under CP the per-token keys, head weights and gate logits are computed on this
            # rank's tokens and gathered (2 Di + Hi values a token, not the hidden state's D);
            # the queries from the gathered low-rank q_resid.
            if self.gather_token_inputs and group_size(cp) > 1:
                k_i, w_i, gate_i = (gather_sequence_with_grad(t, cp, dim=1)
                                    for t in self.indexer.token_inputs(x_BSD.detach()))
                q_i = self.indexer.queries(gather_sequence(q_resid.detach(), cp, dim=1))
            else:  # one CP rank, or the published layout: the hidden state gathered, the inputs computed whole
                q_i, k_i, w_i, gate_i = self.indexer.inputs(gather_sequence(x_BSD.detach(), cp, dim=1),
                                                            gather_sequence(q_resid.detach(), cp, dim=1))

            def select() -> torch.Tensor:
                return dsa_ops.select_tokens(q_i, k_i, w_i, gate_i, self.indexer.index_kpool_compress_ape,
                                             kpool=cfg.index_kpool, topk=cfg.index_topk, backend=self.backend,
                                             chunk=self.query_chunk)[0]

            if self.share_group is not None:  # each rank its share, gathered as int32 pools
                pools = (recompute_memo.reuse(lambda: self._shared_selection(q_i, k_i, w_i, gate_i))
                         if self.keep_selection else self._shared_selection(q_i, k_i, w_i, gate_i))
                idx = dsa_ops.selection_tokens(pools, kpool=cfg.index_kpool, topk=cfg.index_topk)
            elif self.keep_selection:  # kept as int32 pool ids, expanded again when replayed
                idx = recompute_memo.reuse(
                    select, pack=lambda t: dsa_ops.selection_pools(t, kpool=cfg.index_kpool, topk=cfg.index_topk),
                    unpack=lambda p: dsa_ops.selection_tokens(p, kpool=cfg.index_kpool, topk=cfg.index_topk))
            else:
                idx = select()
        if self.absorbed:
            attend, q_att, k_att, w_uk = self._absorbed(q, latent)
        else:
            (attend, q_att, k_att), w_uk = self._per_head(q, latent), None
        if self.indexer is not None and indexer_loss != "off":
            n = slice(None, indexer_tokens)
            share = None
            if self.share_group is not None:
                share = QueryShare(q_i[:, n].shape[1], self.query_chunk, self.share_group)
                reduce_target = share.reduce_to_owner
            else:
                reduce_target = self._sum_over_head_ranks if self._head_groups() else None
            loss = dsa_ops.indexer_loss(
                q_i[:, n], k_i[:, n], w_i[:, n], q_att[:, n], k_att[:, n], idx[:,
                                                                               n] if indexer_loss == "sparse" else None,
                gate_BTD=gate_i[:, n], ape_KD=self.indexer.index_kpool_compress_ape, kpool=cfg.index_kpool,
                scale=self.scale, backend=self.backend, chunk=self.query_chunk, reduce_target=reduce_target,
                w_uk_HED=w_uk)
            if share is not None:  # the value: the group's sum / cp (as before); the gradient: the share's
                loss = summed_over(loss, self.share_group, 1 / group_size(cp))
            else:  # every CP rank the whole loss; the data-parallel sum over CP gives it once
                loss = loss / group_size(cp)
        o = attend(idx)  # [B, S, heads, v_head_dim], this rank's tokens
        out = self.o_proj(o.reshape(B, S, -1).transpose(0, 1))[0]
        return DSAOutput(out, idx, loss)

    def _per_head(self, q, latent):
        """Keys and values per head from kv_b_proj; under context parallel, the whole sequence for
        this rank's head group. Returns (attend(idx) -> o, the loss's q [B,T,h,qk] and k)."""
        cfg, cp = self.cfg, self.cp_group
        kv = self.kv_b_proj(latent.transpose(0, 1))[0].transpose(0, 1)
        k, v = kv.unflatten(-1, (self.heads, -1)).split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q, k, v = (seq_to_heads(t, cp, seq_dim=1, head_dim=2) for t in (q, k.contiguous(), v.contiguous()))

        def attend(idx):
            o, _ = dsa_ops.sparse_attention(q, k, v, idx, scale=self.scale, backend=self.backend,
                                            chunk=self.query_chunk)
            return heads_to_seq(o, cp, seq_dim=1, head_dim=2)

        return attend, q, k

    def _absorbed(self, q, latent):
        """MLA absorbed: with kv_b_proj's rows per head W_UK [qk, C] and W_UV [v, C], the queries
        q W_UK attend over the latent itself (shared by the heads, so a GPU kernel multiplies
        [heads, C] by [C, slots] on tensor cores) and W_UV maps the result back. The op forms
        q W_UK itself and forms it again in backward (C = 512 channels a head, q 256: never
        saved); under context parallel q (not q W_UK) crosses the all-to-all. The latent is
        replicated over tensor parallel (its gradient summed over the ranks, as kv_b_proj's input
        would be) and gathered whole over context parallel (gradient back to its owners).
        Returns (attend(idx) -> o, the loss's q and k, and W_UK of this rank's head group)."""
        cfg, cp = self.cfg, self.cp_group
        C = cfg.kv_lora_rank
        W = self.kv_b_proj.weight.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, C)
        W_UK, W_UV = W[:, : cfg.qk_nope_head_dim], W[:, cfg.qk_nope_head_dim:]
        w_uk = W_UK[head_slice(self.heads, cp)]  # the heads seq_to_heads gives this CP rank
        q = seq_to_heads(q, cp, seq_dim=1, head_dim=2)
        kv = gather_sequence_with_grad(tp_shared(latent, self.tp_group), cp, dim=1)  # [B, T, C]

        def attend(idx):
            o_lat, _ = dsa_ops.sparse_mla(q, kv, idx, scale=self.scale, dv=C, backend=self.backend,
                                          chunk=self.query_chunk, w_uk_HED=w_uk)
            return torch.einsum("bshc,hvc->bshv", heads_to_seq(o_lat, cp, seq_dim=1, head_dim=2), W_UV)

        return attend, q, kv[:, :, None], w_uk  # the loss's k: one key head, shared

    def _shared_selection(self, q_i, k_i, w_i, gate_i) -> torch.Tensor:
        """The whole sequence's selection as int32 pools [B, T, P], this rank selecting for its
        share of the query blocks and the group all-gathering the rest."""
        cfg = self.cfg
        B, T = k_i.shape[:2]
        share = QueryShare(T, self.query_chunk, self.share_group)
        parts = [dsa_ops.select_tokens(q_i, k_i, w_i, gate_i, self.indexer.index_kpool_compress_ape,
                                       kpool=cfg.index_kpool, topk=cfg.index_topk, backend=self.backend,
                                       chunk=self.query_chunk, queries=queries)[0] for queries in share.ranges()]
        P = min(cfg.index_topk // cfg.index_kpool, T // cfg.index_kpool)
        mine = (torch.cat([dsa_ops.selection_pools(p, kpool=cfg.index_kpool, topk=cfg.index_topk, seq_len=T)
                           for p in parts], dim=1) if parts
                else torch.empty(B, 0, P, dtype=torch.int32, device=k_i.device))
        return share.gather(mine)

    def _head_groups(self) -> list:
        """The process groups over which the attention heads are split (TP, CP)."""
        return [g for g in (self.tp_group, self.cp_group) if group_size(g) > 1]

    def _sum_over_head_ranks(self, p: torch.Tensor, block: int) -> torch.Tensor:
        """Sum a block of the indexer loss's target over the ranks holding the other heads."""
        for group in self._head_groups():
            torch.distributed.all_reduce(p, group=group)
        return p
