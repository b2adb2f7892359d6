"""``genome-lm parity``: genome-lm's model against transformers' glm5_next on the same weights.

Loads a checkpoint written by transformers' ``save_pretrained`` twice, in transformers and
through genome-lm's loader, runs both on the same random DNA tokens at each length, and reports
the largest |logit difference| (and |log-probability difference|) per length. Used by users
converting a real checkpoint and by the tests, on random tiny configs.

Ties at the top-k boundary. When the pool with the k-th highest indexer score ties with the next
one (pools of identical content, which genomes are full of, or all-zero ReLU scores), the two
models may keep different pools: genome-lm keeps the lower pool (a documented, tested rule of
its indexer), transformers whatever ``torch.topk`` returns. From the first query with such a tie
on, outputs may differ legitimately: a DSA layer's output at that position feeds every later
position. Each row therefore counts the (layer, query) pairs with a boundary tie and the first
tied position, and judges parity on the positions before it; the difference after it is shown
apart ("after ties").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from genome_lm.engine.backend import on_gpu
from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

DNA_IDS = (4, 5, 6, 7, 8)  # A C G T N in genome-lm's tokenizer


@dataclass
class ParityRow:
    length: int
    max_abs_logit: float  # before the first tied position (all positions without ties)
    mean_abs_logit: float
    max_abs_logprob: float
    passed: bool
    tied_queries: int = 0  # (DSA layer, query) pairs whose top-k boundary is a tie
    first_tie: int | None = None  # the first position with one (None: no tie)
    max_abs_logit_after_ties: float | None = None  # from first_tie on, where the selections may differ


class _IndexerInputs:
    """Records each indexer's (q, k, w, gate, ape, kpool, topk) during a forward of genome-lm's model."""

    def __init__(self, model: GLM5Model):
        self.indexers = [m for m in model.modules() if hasattr(m, "indexer") and m.indexer is not None]
        self.seen: list[tuple] = []

    def __enter__(self):
        for attn in self.indexers:
            real = attn.indexer.inputs

            def record(*args, _real=real, _attn=attn, **kwargs):
                out = _real(*args, **kwargs)
                self.seen.append((*out, _attn.indexer.index_kpool_compress_ape, _attn.cfg.index_kpool,
                                  _attn.cfg.index_topk))
                return out

            attn.indexer.inputs = record
        return self

    def __exit__(self, *exc):
        for attn in self.indexers:
            del attn.indexer.inputs  # back to the class's method


def boundary_ties(q_BTHD, k_BTD, w_BTH, gate_BTD, ape_KD, kpool: int, topk: int, chunk: int = 256) -> torch.Tensor:
    """[B, T] bool: the query's top-k boundary is a tie, i.e. the pool with the k-th highest score
    (k = topk // kpool) scores exactly as much as the best pool left out, on the scores genome-lm's
    selection uses (fp32, ``indexer.pool_scores_chunk``)."""
    from genome_lm_kernels.dsa import indexer

    B, T, _, D = q_BTHD.shape
    kp = indexer.pool_keys(k_BTD, gate_BTD, ape_KD, kpool=kpool)
    n_pick = topk // kpool
    out = torch.zeros(B, T, dtype=torch.bool)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        N = min(kp.shape[1], t1 // kpool)
        if N <= n_pick:
            continue
        scores = indexer.pool_scores_chunk(q_BTHD[:, t0:t1], kp[:, :N], w_BTH[:, t0:t1], t0, D**-0.5, kpool)
        top = scores.topk(n_pick + 1, dim=-1).values  # descending
        out[:, t0:t1] = (top[..., n_pick - 1] == top[..., n_pick]) & torch.isfinite(top[..., n_pick])
    return out


def _import_transformers_model():
    """transformers' glm5_next class, with flash-linear-attention hidden on a CPU machine: when fla
    is importable, glm5_next swaps its torch KDA for fla's Triton kernels, which fail without a
    GPU (DESIGN.md section 6). The torch path is the independent reference we want."""
    if not on_gpu() and "fla" not in sys.modules:
        sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        import transformers
        from transformers import Glm5NextForConditionalGeneration
    except ImportError as exc:
        raise GenomeLMError(f"parity needs transformers >= 5.16.1 with glm5_next ({exc})") from None
    transformers.logging.set_verbosity_error()  # its "falling back to torch" notes are expected here
    return Glm5NextForConditionalGeneration


def run_parity(hf_dir: str | Path, lengths: list[int], *, tol: float = 1e-4, seed: int = 0,
               kernel_backend: str = "auto", progress=None) -> list[ParityRow]:
    from genome_lm.engine.parallel import ParallelSizes, parallel_context

    from genome_lm.checkpoint.huggingface import HFCheckpoint, load_hf_checkpoint
    from genome_lm.model.model import build_model

    hf_dir = Path(hf_dir)
    cfg = HFCheckpoint(hf_dir).config()
    hf_class = _import_transformers_model()
    hf_model = hf_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = [i for i in DNA_IDS if i < cfg.vocab_size] or list(range(cfg.vocab_size))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    with parallel_context() as pg:
        model = build_model(cfg, pg, ParallelSizes(), kernel_backend=kernel_backend).eval()
        load_hf_checkpoint(model, hf_dir)
        for length in lengths:
            ids = torch.tensor(vocab)[torch.randint(len(vocab), (1, length), generator=gen)]
            with torch.no_grad(), _IndexerInputs(model) as recorded:
                ours = model(ids).logits.float()
                theirs = hf_model(input_ids=ids).logits.float()
                tied = torch.zeros(1, length, dtype=torch.bool)
                count = 0
                for inputs in recorded.seen:
                    layer_ties = boundary_ties(*inputs)
                    count += int(layer_ties.sum())
                    tied |= layer_ties
            first = int(tied[0].nonzero()[0]) if bool(tied.any()) else None
            cut = length if first is None else first
            diff = (ours - theirs).abs()
            lp = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs()
            finite = bool(torch.isfinite(ours).all() and torch.isfinite(theirs).all())
            before = diff[:, :cut]
            max_before = before.max().item() if before.numel() else 0.0
            row = ParityRow(length, max_before, before.mean().item() if before.numel() else 0.0,
                            lp[:, :cut].max().item() if before.numel() else 0.0, finite and max_before <= tol,
                            tied_queries=count, first_tie=first,
                            max_abs_logit_after_ties=None if first is None else diff[:, first:].max().item())
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
