"""Per-window scores kept on disk while an evaluation runs, so that an interrupted
``genome-lm eval`` picks up where it stopped.

A chromosome at 512k-1M tokens per window is hours of scoring per model; each window's NLL
array is written (atomically) to ``<out>/.scores/<model>-<key>/window-<index>.npy`` as soon as
it is scored, and a re-run with the same inputs loads it instead of scoring the window again.
The key covers everything the scores depend on: the weights (a fingerprint of every tensor),
the token mapping, the dataset's manifest, the split, the prefill chunk, and the device and
dtype the model runs in. Change any of them and the scores go to another folder; nothing stale
is ever reused. A file that does not load as the window's array (a partial write from a killed
process cannot happen, but a disk can be damaged) is scored again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash over every parameter and buffer: name, shape, dtype, and its sum and sum of
    squares in float64 (one pass over the weights, on the device they are on)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers()), key=lambda kv: kv[0]):
            x = t.detach().double()
            digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{x.sum().item()!r}:{(x * x).sum().item()!r}".encode())
    return digest.hexdigest()


def score_key(model: torch.nn.Module, token_map: torch.Tensor | None, dataset: Path, split: str,
              chunk: int | None, layout: dict | None = None) -> str:
    """The cache folder's key: the weights, token map, dataset, split, chunk and device, and for
    an evaluation over many ranks their layout (rank 0's key: its weights are its shard)."""
    first = next(model.parameters(), None)
    parts = {
        "weights": weights_fingerprint(model),
        "token_map": None if token_map is None else token_map.tolist(),
        "manifest": hashlib.sha256((Path(dataset) / "manifest.json").read_bytes()).hexdigest(),
        "split": split,
        "chunk": chunk,
        "device": None if first is None else f"{first.device.type}:{first.dtype}",
    }
    if layout is not None:
        parts["layout"] = layout
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class WindowCache:
    """The scored windows of one model in ``folder``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _path(self, window: int) -> Path:
        return self.folder / f"window-{window:07d}.npy"

    def load(self, window: int, length: int) -> np.ndarray | None:
        """The window's NLL [length] (float64), or None when it is not there or unreadable."""
        path = self._path(window)
        if not path.is_file():
            return None
        try:
            nll = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None
        if nll.shape != (length,) or nll.dtype not in (np.float32, np.float64):
            return None
        return nll.astype(np.float64)

    def store(self, window: int, nll: np.ndarray) -> None:
        """Write atomically (a temporary file renamed into place). float32 when that keeps every
        value exactly (the cross-entropy is computed in float32), else float64."""
        self.folder.mkdir(parents=True, exist_ok=True)
        narrow = nll.astype(np.float32)
        data = narrow if np.array_equal(narrow.astype(np.float64), nll, equal_nan=True) else nll
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".window-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, data, allow_pickle=False)
            os.replace(tmp, self._path(window))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def has(self, window: int, length: int | None = None) -> bool:
        """Whether the window's scores are there; with ``length``, whether they load as its array
        (a damaged file is then removed, so that whoever asks next sees it missing too: rank 0
        must decide what every rank scores from what it can read back, not from what exists)."""
        if length is None:
            return self._path(window).is_file()
        if self.load(window, length) is not None:
            return True
        self._path(window).unlink(missing_ok=True)
        return False
