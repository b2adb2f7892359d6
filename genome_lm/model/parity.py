"""``genome-lm parity``: genome-lm's model against transformers' glm5_next on the same weights.

Loads a checkpoint written by transformers' ``save_pretrained`` twice, in transformers and
through genome-lm's loader, runs both on the same random DNA tokens at each length, and reports
the largest |logit difference| (and |log-probability difference|) per length. Used by users
converting a real checkpoint and by the tests, on random tiny configs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from genome_lm.errors import GenomeLMError

DNA_IDS = (4, 5, 6, 7, 8)  # A C G T N in genome-lm's tokenizer


@dataclass
class ParityRow:
    length: int
    max_abs_logit: float
    mean_abs_logit: float
    max_abs_logprob: float
    passed: bool


def _import_transformers_model():
    """transformers' glm5_next class, with flash-linear-attention hidden on a CPU machine: when fla
    is importable, glm5_next swaps its torch KDA for fla's Triton kernels, which fail without a
    GPU (DESIGN.md section 6). The torch path is the independent reference we want."""
    if not torch.cuda.is_available() and "fla" not in sys.modules:
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

    from .hf_checkpoint import HFCheckpoint, load_hf_checkpoint
    from .model import build_model

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
            with torch.no_grad():
                ours = model(ids).logits.float()
                theirs = hf_model(input_ids=ids).logits.float()
            diff = (ours - theirs).abs()
            lp = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs()
            finite = bool(torch.isfinite(ours).all() and torch.isfinite(theirs).all())
            row = ParityRow(length, diff.max().item(), diff.mean().item(), lp.max().item(),
                            finite and diff.max().item() <= tol)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
