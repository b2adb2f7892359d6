"""Bases onto a pretrained checkpoint's own vocabulary.

genome-lm's datasets hold its 9 DNA ids (``tokenizer.VOCAB``). A pretrained GLM-5.3-Flash has a
154,880-token BPE vocabulary; fine-tuning it on DNA feeds it the single-letter tokens "A", "C",
"G", "T" and "N" from that vocabulary, so what it already knows about those letters is the
starting point. ``checkpoint_token_map`` reads the checkpoint's ``tokenizer.json`` (the
Hugging Face tokenizers format that ``save_pretrained`` writes) and returns a table that turns
genome-lm ids into checkpoint ids: ``model_ids = table[dataset_ids]``. ``<pad>`` maps to the
config's ``pad_token_id``; ``<bos>``/``<eos>``/``<mask>`` map to the tokenizer's special tokens
of those names when present, else to the pad id (they never occur in training windows).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from genome_lm.errors import GenomeLMError

from .tokenizer import VOCAB

LETTERS = ("A", "C", "G", "T", "N")


def _vocab(tokenizer_json: Path) -> dict[str, int]:
    try:
        data = json.loads(tokenizer_json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GenomeLMError(f"{tokenizer_json}: unreadable tokenizer ({exc})") from None
    vocab = dict(data.get("model", {}).get("vocab") or {})
    for token in data.get("added_tokens", []):
        vocab.setdefault(token["content"], token["id"])
    if not vocab:
        raise GenomeLMError(f"{tokenizer_json}: no model.vocab (only BPE/WordPiece/WordLevel vocabularies are read)")
    return vocab


def checkpoint_token_map(checkpoint: str | Path, pad_token_id: int | None) -> torch.Tensor:
    """int64 [9]: genome-lm id -> the checkpoint's id."""
    path = Path(checkpoint) / "tokenizer.json"
    if not path.exists():
        raise GenomeLMError(f"{path}: missing; a checkpoint with its own vocabulary needs its tokenizer to map "
                            "bases onto it")
    vocab = _vocab(path)
    missing = [letter for letter in LETTERS if letter not in vocab]
    if missing:
        raise GenomeLMError(f"{path}: no single-letter token for {', '.join(missing)}")
    pad = pad_token_id if pad_token_id is not None else vocab.get("<pad>", vocab["N"])
    table = np.empty(len(VOCAB), dtype=np.int64)
    for i, name in enumerate(VOCAB):
        if name in LETTERS:
            table[i] = vocab[name]
        elif name == "<pad>":
            table[i] = pad
        else:
            table[i] = vocab.get(name, pad)
    return torch.from_numpy(table)
