"""DeepSeek sparse attention with a k-pool lightning indexer (GLM-5.3-Flash).

The public ops take a backend resolved once with ``genome_lm_kernels.resolve_backend``; they
run its ``dsa`` path ("reference" | "torch" | "triton": every GPU backend runs the Triton
kernels here, with fp32 products under "triton-fp32"):

    select_tokens(q_idx [B,T,Hi,Di], k_idx [B,T,Di], w_idx [B,T,Hi], gate [B,T,Di] | None,
                  ape [kpool,Di] | None, *, kpool, topk, scale=None, backend, chunk=64,
                  queries=(first, end) | None)
        -> idx [B,T,S] int32 (-1 = empty slot), valid [B,T,S] bool;  S = topk + kpool - 1
        (with queries: [B, end - first, S], those queries' rows of the whole call)
    select_from_pools(q_idx [B,S,Hi,Di], kp [B,N,Di], w_idx [B,S,Hi], *, kpool, topk, n_pick, t0=0,
                      scale=None, backend, chunk=64) -> idx [B,S,slots] int32
        (queries t0 .. t0+S-1 from the pooled keys so far: a chunked prefill's selection)
    sparse_attention(q [B,T,H,Dqk], k [B,T,H,Dqk], v [B,T,H,Dv], idx [B,T,S], *, scale,
                     backend, chunk=64) -> o [B,T,H,Dv], lse [B,T,H]
    sparse_mla(q [B,T,H,D], kv [B,T,D], idx [B,T,S], *, scale, dv, backend, chunk=64)
        -> o [B,T,H,dv], lse [B,T,H]   (absorbed MLA: keys kv, values kv[..., :dv], shared by the heads)
    indexer_loss(q_idx, k_idx, w_idx, q, k, idx=None, *, gate=None, ape=None, kpool,
                 idx_scale=None, scale, backend, chunk=64) -> scalar KL loss
        (idx=None: dense warm-up mode; idx from select_tokens: sparse mode)
    selection_pools(idx [B,T,S], *, kpool, topk, seq_len=T) -> pools [B,T,P] int32;  selection_tokens(pools, ...) -> idx
        (a selection's compact form and back)

The reference backend builds [T, T] tensors (small T only); "torch" and "triton" never do.
"""

from __future__ import annotations

import torch

from genome_lm_kernels import KernelBackend, resolved

from . import indexer as _indexer
from . import loss as _loss
from . import mla as _mla
from . import reference as _reference
from . import sparse_attention as _sparse

__all__ = ["select_tokens", "sparse_attention", "sparse_mla", "indexer_loss", "pool_keys", "selection_pools",
           "selection_tokens"]

pool_keys = _indexer.pool_keys
# a selection's compact form (int32 pool ids) and back, for keeping it across recompute
selection_pools = _indexer.selection_pools
selection_tokens = _indexer.selection_tokens


def sparse_mla(q_BTHD, kv_BTD, idx_BTS, *, scale: float, dv: int, backend: KernelBackend, chunk: int = 64,
               w_uk_HED=None):
    """Attention of each query's heads over its selected rows of a latent shared by the heads
    (``mla.py``): keys kv, values kv[..., :dv]. lse is fp32 (fp64 for fp64 inputs on the
    torch and reference paths). "triton" runs the products on tensor cores (bf16 operands),
    "triton-fp32" in fp32. With ``w_uk_HED`` [H, E, D] the queries are per head, q [B, T, H, E],
    absorbed as q W_UK inside the op and again in backward (never saved)."""
    D = kv_BTD.shape[-1]
    width = q_BTHD.shape[-1] if w_uk_HED is None else w_uk_HED.shape[-1]
    if not 0 < dv <= D or width != D or (w_uk_HED is not None and w_uk_HED.shape[:2] != q_BTHD.shape[2:]):
        raise ValueError(f"sparse_mla needs q [..., D] (or q [..., H, E] with w_uk [H, E, D]) and kv [..., D], "
                         f"0 < dv <= D; got q {tuple(q_BTHD.shape)}, kv {tuple(kv_BTD.shape)}, dv {dv}"
                         + ("" if w_uk_HED is None else f", w_uk {tuple(w_uk_HED.shape)}"))
    path = resolved(backend, "sparse_mla").dsa
    if path == "reference":
        q = q_BTHD if w_uk_HED is None else torch.einsum("bthe,hed->bthd", q_BTHD, w_uk_HED)
        return _mla.sparse_mla_reference(q, kv_BTD, idx_BTS, scale=scale, dv=dv)
    if path == "torch":
        return _mla.sparse_mla(q_BTHD, kv_BTD, idx_BTS, scale=scale, dv=dv, chunk=chunk, w_uk_HED=w_uk_HED)
    from . import triton_mla

    return triton_mla.sparse_mla(q_BTHD, kv_BTD, idx_BTS, scale=scale, dv=dv, exact=backend.exact, w_uk_HED=w_uk_HED)


def _score_fn(path: str):
    """The selection's pool scores on the torch path, or the Triton kernel's."""
    if path == "torch":
        return _indexer.torch_scores
    from . import triton as _triton

    return _triton.pool_scores_chunk


def select_tokens(q_idx_BTHD, k_idx_BTD, w_idx_BTH, gate_BTD=None, ape_KD=None, *, kpool: int, topk: int,
                  scale: float | None = None, backend: KernelBackend, chunk: int = 64,
                  queries: tuple[int, int] | None = None):
    """Top topk // kpool complete pools per query (causal), expanded to tokens, plus the
    query's incomplete tail pool; see ``indexer`` for the slot layout and tie rule.
    ``queries`` = (first, end), first a multiple of ``chunk``: only those queries' selections
    (the rows a whole-sequence call gives them)."""
    path = resolved(backend, "select_tokens").dsa
    if path == "reference":
        scale = q_idx_BTHD.shape[-1] ** -0.5 if scale is None else scale
        B, T, _ = k_idx_BTD.shape
        q0, q1 = _indexer.query_range(queries, T, chunk)
        gate = gate_BTD if gate_BTD is not None else k_idx_BTD.new_zeros(B, T, k_idx_BTD.shape[-1])
        ape = ape_KD if ape_KD is not None else k_idx_BTD.new_zeros(kpool, k_idx_BTD.shape[-1])
        with torch.no_grad():
            idx, valid = _reference.select_tokens(q_idx_BTHD, k_idx_BTD, w_idx_BTH, gate, ape,
                                                  kpool=kpool, topk=topk, scale=scale)
        return idx[:, q0:q1], valid[:, q0:q1]
    score_fn = _score_fn(path)
    return _indexer.select_tokens(q_idx_BTHD, k_idx_BTD, w_idx_BTH, gate_BTD, ape_KD, kpool=kpool, topk=topk,
                                  scale=scale, chunk=chunk, score_fn=score_fn, queries=queries,
                                  use_native=backend.native)


def select_from_pools(q_idx_BSHD, kp_BND, w_idx_BSH, *, kpool: int, topk: int, n_pick: int, t0: int = 0,
                      scale: float | None = None, backend: KernelBackend, chunk: int = 64):
    """``select_tokens`` for queries t0 .. t0+S-1 given the pooled keys complete so far (kp
    [B, N, D], ``pool_keys``' output) and ``n_pick`` pool slots: what a chunked prefill calls
    chunk by chunk, getting the whole sequence's selection (blocks end at multiples of ``chunk``)."""
    path = resolved(backend, "select_from_pools").dsa
    scale = q_idx_BSHD.shape[-1] ** -0.5 if scale is None else scale
    if path == "reference":
        return _reference.select_from_pools(q_idx_BSHD, kp_BND, w_idx_BSH, kpool=kpool, topk=topk, scale=scale,
                                            n_pick=n_pick, t0=t0)
    score_fn = _score_fn(path)
    return _indexer.select_from_pools(q_idx_BSHD, kp_BND, w_idx_BSH, kpool=kpool, topk=topk, scale=scale,
                                      n_pick=n_pick, t0=t0, chunk=chunk, score_fn=score_fn, use_native=backend.native)


def sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, *, scale: float, backend: KernelBackend, chunk: int = 64):
    """Attention of each query over its selected keys only. lse is fp32 (fp64 for fp64 inputs on
    the torch and reference paths); a query with no key gets o = 0, lse = -inf."""
    path = resolved(backend, "sparse_attention").dsa
    if path == "reference":
        return _reference.sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale=scale)
    if path == "torch":
        return _sparse.sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale=scale, chunk=chunk,
                                        use_native=backend.native)
    from . import triton as _triton

    return _triton.sparse_attention(q_BTHD, k_BTHD, v_BTHD, idx_BTS, scale=scale)


def indexer_loss(q_idx_BTHD, k_idx_BTD, w_idx_BTH, q_BTHD, k_BTHD, idx_BTS=None, *, gate_BTD=None, ape_KD=None,
                 kpool: int, idx_scale: float | None = None, scale: float, backend: KernelBackend, chunk: int = 64,
                 reduce_target=None, w_uk_HED=None):
    """KL(p || softmax(I)) over pools (see ``loss``). Gradient reaches q_idx, k_idx, w_idx, gate,
    ape only. The "triton" backend runs the chunked torch loss (no Triton loss kernel yet).
    ``reduce_target(p, block)``: q, k hold some of the heads; it sums a target block over the
    ranks that hold the others and returns it where this rank computes that query block's loss,
    None where another rank does (``loss``; not for the reference backend). ``w_uk_HED``: q holds per-head queries
    absorbed with it (absorbed MLA, k the shared latent [B, T, 1, D])."""
    path = resolved(backend, "indexer_loss").dsa
    if path == "reference":
        if w_uk_HED is not None:
            q_BTHD = torch.einsum("bthe,hed->bthd", q_BTHD, w_uk_HED)
        if reduce_target is not None:
            raise ValueError("the reference indexer loss takes every head; reduce_target is for the chunked paths")
        idx_scale = q_idx_BTHD.shape[-1] ** -0.5 if idx_scale is None else idx_scale
        B, T, D = k_idx_BTD.shape
        gate = gate_BTD if gate_BTD is not None else k_idx_BTD.new_zeros(B, T, D)
        ape = ape_KD if ape_KD is not None else k_idx_BTD.new_zeros(kpool, D)
        return _reference.indexer_loss(q_idx_BTHD, k_idx_BTD, w_idx_BTH, gate, ape, q_BTHD, k_BTHD, idx_BTS,
                                       kpool=kpool, idx_scale=idx_scale, scale=scale)
    return _loss.indexer_loss(q_idx_BTHD, k_idx_BTD, w_idx_BTH, q_BTHD, k_BTHD, idx_BTS, gate_BTD=gate_BTD,
                              ape_KD=ape_KD, kpool=kpool, idx_scale=idx_scale, scale=scale, chunk=chunk,
                              reduce_target=reduce_target, w_uk_HED=w_uk_HED, use_native=backend.native)
