"""Chunked prefill: a long sequence through the model a chunk of tokens at a time.

A full forward holds every layer's activations for the whole window; at 1M tokens that does not
fit. Here each layer keeps only what later tokens need and the activations of one chunk live at
a time:

- KDA layers carry their short-convolution inputs and the fp32 recurrent state
  (``KDAAttention.forward(x, state, return_state=True)``): constant memory.
- DSA layers carry, per token, the MLA latent ``kv_a_layernorm(kv_a_proj(x))`` (``kv_lora_rank``
  values) and the indexer's pooled keys (one per complete pool of ``index_kpool`` tokens), plus
  the incomplete pool's raw indexer keys and gate logits. That is the only memory that grows
  with the window: ``kv_lora_rank + index_head_dim / index_kpool`` values per token per DSA
  layer (``Prefill.cache_bytes``), not the per-head keys and values (for GLM-5.3-Flash 64 heads x
  512 values: 64x more).
- Attention runs in MLA's absorbed form over the gathered latents: the key up-projection is
  folded into the query (``q W_uk`` against the latent) and the value up-projection applied to
  the weighted latent, the same function as the training forward's per-head keys and values up
  to rounding (matrix products reassociated).
- Token selection reuses the indexer's own pieces (``pool_keys``, the pool scores, ``pick_pools``,
  ``expand_to_tokens``) at absolute query positions, with query blocks aligned to the same
  boundaries as the layer's ``select_tokens`` call (``query_chunk``): a chunk selects what the full forward selects.

MoE, mHC, norms and the output layer act token by token and need no state. One process only
(no tensor or context parallel): evaluation and parity checks run the model whole.

    prefill = Prefill(model, total_tokens=T)
    for start in range(0, T, chunk):
        logits_BCV = prefill(ids[:, start:start + chunk])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genome_lm_kernels import dsa as dsa_ops
from genome_lm_kernels.dsa import indexer as dsa_indexer
from genome_lm_kernels.dsa.indexer import compute_dtype
from genome_lm_kernels.dsa.sparse_attention import GATHER_ELEMENTS, gather_rows, own_keys

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model
    from genome_lm_kernels import KernelBackend

SELECT_BLOCK = 64  # queries per indexer block when the layer sets none: select_tokens' default


class GrowingBuffer:
    """A ``[B, T, ...]`` tensor appended to along T. With ``capacity`` known, one allocation;
    otherwise the capacity doubles (amortised copies, at most 2x the used memory)."""

    def __init__(self, capacity: int | None = None):
        self.capacity_hint = capacity
        self.data: torch.Tensor | None = None
        self.length = 0

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[1]
        if self.data is None:
            cap = max(n, self.capacity_hint or 0)
            self.data = x.new_empty(x.shape[0], cap, *x.shape[2:])
        elif self.length + n > self.data.shape[1]:
            grown = x.new_empty(x.shape[0], max(2 * self.data.shape[1], self.length + n), *x.shape[2:])
            grown[:, : self.length] = self.data[:, : self.length]
            self.data = grown
        self.data[:, self.length : self.length + n] = x
        self.length += n

    def view(self) -> torch.Tensor:
        return self.data[:, : self.length]

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def repeat(self, n: int) -> GrowingBuffer:
        """A copy whose one sequence is repeated ``n`` times along the batch, capacity kept."""
        out = GrowingBuffer(self.capacity_hint)
        out.length = self.length
        out.data = None if self.data is None else _rows(self.data, n)
        return out


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    if t.shape[0] != 1:
        raise ValueError(f"only a prefill of one sequence can be forked (batch {t.shape[0]})")
    return t.repeat(n, *([1] * (t.dim() - 1)))


class KDACache:
    """A KDA layer's carried state (short-conv inputs and recurrent state)."""

    def __init__(self):
        self.state = None

    def attend(self, attn, x_SBD: torch.Tensor, idx):
        out, self.state = attn(x_SBD, self.state, return_state=True)
        return out, idx

    @property
    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.state.conv, self.state.recurrent))

    def repeat(self, n: int) -> KDACache:
        out = KDACache()
        if self.state is not None:
            out.state = type(self.state)(_rows(self.state.conv, n), _rows(self.state.recurrent, n))
        return out


class DSACache:
    """A DSA layer's carried keys: MLA latents of every token, the indexer's pooled keys, and the
    raw indexer keys / gate logits of the incomplete last pool."""

    def __init__(self, attn, total_tokens: int | None = None):
        cfg = attn.cfg
        self.kpool, self.topk = cfg.index_kpool, cfg.index_topk
        self.latent = GrowingBuffer(total_tokens)
        self.pooled = GrowingBuffer(None if total_tokens is None else total_tokens // self.kpool)
        self.tail: tuple[torch.Tensor, torch.Tensor] | None = None  # indexer keys, gate logits [B, <kpool, Di]
        # pools per query in the slot layout: as in a full forward over total_tokens
        n_pick = self.topk // self.kpool
        self.n_pick = n_pick if total_tokens is None else min(n_pick, total_tokens // self.kpool)

    @property
    def length(self) -> int:
        return self.latent.length

    @property
    def nbytes(self) -> int:
        tail = 0 if self.tail is None else sum(t.numel() * t.element_size() for t in self.tail)
        return self.latent.nbytes + self.pooled.nbytes + tail

    def repeat(self, n: int) -> DSACache:
        out = DSACache.__new__(DSACache)
        out.kpool, out.topk, out.n_pick = self.kpool, self.topk, self.n_pick
        out.latent, out.pooled = self.latent.repeat(n), self.pooled.repeat(n)
        out.tail = None if self.tail is None else tuple(_rows(t, n) for t in self.tail)
        return out

    def attend(self, attn, x_SBD: torch.Tensor, shared_idx):
        """The DSA layer on S new tokens (``DSAAttention.forward`` without the indexer loss):
        x [S, B, hidden] -> (out [S, B, hidden], selection [B, S, slots])."""
        cfg = attn.cfg
        S, B, _ = x_SBD.shape
        t0 = self.length
        x_BSD = x_SBD.transpose(0, 1)
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x_BSD))
        q = attn.q_b_proj(q_resid.transpose(0, 1))[0].transpose(0, 1).unflatten(-1, (attn.heads, cfg.qk_head_dim))
        self.latent.append(attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x_BSD)))
        if attn.indexer is None:
            if shared_idx is None:
                raise ValueError("a shared DSA layer needs the selection of a previous full layer")
            idx = shared_idx
        else:
            q_i, k_i, w_i, gate_i = attn.indexer.inputs(x_BSD, q_resid)
            self._add_pool_keys(k_i, gate_i, attn.indexer.index_kpool_compress_ape)
            idx = self._select(q_i, w_i, t0, attn.backend, getattr(attn, "query_chunk", SELECT_BLOCK))
        wkv = attn.kv_b_proj.weight.view(attn.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        wk_HDR, wv_HVR = wkv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        o = absorbed_sparse_attention(q, self.latent.view(), idx, wk_HDR, wv_HVR, scale=attn.scale)
        out = attn.o_proj(o.to(x_SBD.dtype).reshape(B, S, -1).transpose(0, 1))[0]
        return out, idx

    def _add_pool_keys(self, k_BSD, gate_BSD, ape_KD) -> None:
        if self.tail is not None:
            k_BSD, gate_BSD = torch.cat([self.tail[0], k_BSD], 1), torch.cat([self.tail[1], gate_BSD], 1)
        n = k_BSD.shape[1] // self.kpool * self.kpool  # the buffered tokens start at a pool boundary
        if n:
            self.pooled.append(dsa_indexer.pool_keys(k_BSD[:, :n], gate_BSD[:, :n], ape_KD, kpool=self.kpool))
        self.tail = (k_BSD[:, n:], gate_BSD[:, n:])

    def _select(self, q_BSHD, w_BSH, t0: int, backend: KernelBackend, block: int) -> torch.Tensor:
        """Selected tokens of queries t0 .. t0+S-1: [B, S, slots] (``select_tokens``' layout), in
        query blocks at the same multiples of ``block`` as the full forward's (the public DSA op,
        run as the backend says)."""
        B = q_BSHD.shape[0]
        kp_BND = self.pooled.view() if self.pooled.data is not None else q_BSHD.new_zeros(B, 0, q_BSHD.shape[-1])
        return dsa_ops.select_from_pools(q_BSHD, kp_BND, w_BSH, kpool=self.kpool, topk=self.topk,
                                         n_pick=self.n_pick, t0=t0, backend=backend, chunk=block)


def absorbed_sparse_attention(q_BSHD, latent_BTR, idx_BSK, wk_HDR, wv_HVR, *, scale: float) -> torch.Tensor:
    """MLA attention of S queries over their selected tokens, from the cached latents.

    q [B, S, H, Dqk]; latent [B, T, R] (all tokens so far); idx [B, S, K] absolute token ids,
    -1 empty (a repeated id counts once); wk [H, Dqk, R], wv [H, Dv, R]: the key and value rows of
    ``kv_b_proj``. Per head, softmax(scale * q W_k lat^T) lat W_v^T, computed as
    (q W_k) . lat and (p . lat) W_v^T so no per-head key or value is ever built. Returns
    o [B, S, H, Dv] in fp32 (fp64 for fp64 inputs); a query without a key gets 0."""
    dt = compute_dtype(q_BSHD.dtype)
    B, S, H, _ = q_BSHD.shape
    R = latent_BTR.shape[-1]
    K = idx_BSK.shape[-1]
    qa_BSHR = torch.einsum("bshd,hdr->bshr", q_BSHD.to(dt), wk_HDR.to(dt))
    wv_HVR = wv_HVR.to(dt)
    out = torch.empty(B, S, H, wv_HVR.shape[1], dtype=dt, device=q_BSHD.device)
    C = max(1, min(S, GATHER_ELEMENTS // max(1, K * R)))
    for b in range(B):
        for c0 in range(0, S, C):
            c1 = min(c0 + C, S)
            key_CK, valid_CK = own_keys(idx_BSK[b, c0:c1])
            lat_CKR = gather_rows(latent_BTR[b], key_CK).to(dt)
            s_CKH = torch.bmm(lat_CKR, qa_BSHR[b, c0:c1].transpose(1, 2)).mul_(scale)
            s_CKH.masked_fill_(~valid_CK[..., None], float("-inf"))
            p_CKH = torch.softmax(s_CKH, dim=1).nan_to_num_(0.0)
            o_CHR = torch.bmm(p_CKH.transpose(1, 2), lat_CKR)
            out[b, c0:c1] = torch.einsum("chr,hvr->chv", o_CHR, wv_HVR)
    return out


class Prefill:
    """Feeds one batch of sequences through ``model`` chunk by chunk; each call continues where
    the last stopped. ``total_tokens`` (optional) sizes the DSA caches once and fixes the
    selection layout to that of a full forward over that many tokens."""

    def __init__(self, model: GLM5Model, *, total_tokens: int | None = None):
        if model.pg.tp.size() > 1 or model.pg.cp.size() > 1:
            raise ValueError("chunked prefill runs the whole model in one process (no tensor or context parallel)")
        self.model = model
        self.caches = [KDACache() if layer.is_kda else DSACache(layer.self_attention, total_tokens)
                       for layer in model.layers]
        self.position = 0

    @torch.no_grad()
    def __call__(self, ids_BC: torch.Tensor) -> torch.Tensor:
        """ids [B, C] -> logits [B, C, V] of these tokens, given everything fed before."""
        logits = self.model(ids_BC, caches=self.caches).logits
        self.position += ids_BC.shape[1]
        return logits

    @property
    def cache_bytes(self) -> int:
        """Bytes held between chunks (what grows with the sequence)."""
        return sum(c.nbytes for c in self.caches)

    def fork(self, n: int) -> Prefill:
        """``n`` copies of this one-sequence prefill as one batch of ``n``: each row continues
        from the same prefix (variant scoring: the alleles after their shared context)."""
        out = Prefill.__new__(Prefill)
        out.model, out.position = self.model, self.position
        out.caches = [c.repeat(n) for c in self.caches]
        return out


def chunked_logits(model: GLM5Model, ids_BT: torch.Tensor, chunk: int):
    """Yield (start, logits [B, c, V]) for consecutive chunks of ``ids``."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    prefill = Prefill(model, total_tokens=ids_BT.shape[1])
    for start in range(0, ids_BT.shape[1], chunk):
        yield start, prefill(ids_BT[:, start:start + chunk])
