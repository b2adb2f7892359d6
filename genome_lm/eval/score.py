"""Per-token negative log-likelihood of a model on the windows of a prepared split.

Each window is scored as one sequence from its first base: the base at window offset j (j >= 1)
is predicted from the j bases before it, so its *context* is j (``buckets`` groups by it). N
targets are excluded; soft-masked (lowercase) targets are kept and flagged, so they can be
reported apart.

A window is run either in one forward (``chunk=None``) or by chunked prefill
(``genome_lm.model.prefill``): ``chunk`` tokens at a time with the KDA state and DSA keys carried
over, so memory is bounded by the chunk (plus the carried keys) whatever the window length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from genome_lm.data.tokenizer import N
from genome_lm.data.windows import MAX_N_FRACTION, too_many_n
from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model


@dataclass
class TokenScores:
    nll: np.ndarray  # float64 [N] nats
    context: np.ndarray  # int64 [N] bases before the scored base in its window (= its window offset)
    window: np.ndarray  # int64 [N] window index in the split
    softmasked: np.ndarray  # bool [N]

    @property
    def mean(self) -> float:
        return float(self.nll.mean()) if self.nll.size else float("nan")

    def same_tokens(self, other: "TokenScores") -> bool:
        """Whether ``other`` scores the same tokens (windows and contexts, in the same order)."""
        return np.array_equal(self.context, other.context) and np.array_equal(self.window, other.window)

    @classmethod
    def empty(cls) -> "TokenScores":
        return cls(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))

    @classmethod
    def concat(cls, parts: list["TokenScores"]) -> "TokenScores":
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("nll", "context", "window",
                                                                              "softmasked")))


def select_windows(windows, *, max_windows: int | None = None, max_n_fraction: float = MAX_N_FRACTION) -> list[int]:
    """Indices of the split's windows to score: those with at most ``max_n_fraction`` N, and of
    them ``max_windows`` evenly spaced ones (all when None)."""
    keep = [i for i, w in enumerate(windows) if not too_many_n(w.n_frac, max_n_fraction) and w.length >= 2]
    if max_windows is not None and len(keep) > max_windows:
        picks = np.linspace(0, len(keep) - 1, max_windows).round().astype(int)
        keep = [keep[i] for i in sorted(set(picks.tolist()))]
    return keep


def model_device(model: GLM5Model) -> torch.device:
    """Where the model's parameters are (``build_model`` puts them on the GPU when there is one):
    the device its inputs go to; the CPU for a model without parameters."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _model_ids(model: GLM5Model, tokens: np.ndarray, token_map: torch.Tensor | None,
               device: torch.device | str | None) -> torch.Tensor:
    """genome-lm token ids [L] as the model's ids (through ``token_map``) on ``device`` (default:
    the model's)."""
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    if token_map is not None:
        ids = token_map[ids]
    return ids.to(device or model_device(model))


@torch.no_grad()
def token_nll(model: GLM5Model, tokens: np.ndarray, *, chunk: int | None = None, token_map: torch.Tensor | None = None,
              device: torch.device | str | None = None, on_chunk=None) -> np.ndarray:
    """NLL [L - 1] (nats, float64) of tokens[1:] given the tokens before each, for one sequence
    of genome-lm token ids, computed on ``device`` (default: the model's). ``token_map``:
    genome-lm id -> model id (a pretrained vocabulary). ``on_chunk(n)`` is called after each n
    predicted tokens (progress)."""
    ids = _model_ids(model, tokens, token_map, device)[None]
    inputs, targets = ids[:, :-1], ids[0, 1:]
    L = inputs.shape[1]
    out = np.empty(L, dtype=np.float64)
    if chunk is None or chunk >= L:
        logits = model(inputs).logits[0].float()
        out[:] = torch.nn.functional.cross_entropy(logits, targets, reduction="none").double().cpu().numpy()
        if on_chunk is not None:
            on_chunk(L)
        return out
    from genome_lm.model.prefill import chunked_logits

    for start, logits in chunked_logits(model, inputs, chunk):
        n = logits.shape[1]
        out[start:start + n] = torch.nn.functional.cross_entropy(
            logits[0].float(), targets[start:start + n], reduction="none").double().cpu().numpy()
        if on_chunk is not None:
            on_chunk(n)
    return out


@torch.no_grad()
def token_nll_cut(model: GLM5Model, tokens: np.ndarray, max_context: int, *, chunk: int | None = None,
                  token_map: torch.Tensor | None = None, device: torch.device | str | None = None,
                  on_chunk=None) -> np.ndarray:
    """``token_nll`` with every target seeing at most ``max_context`` tokens: the sequence is cut
    into segments of ``max_context`` inputs, each scored alone from scratch (segment s predicts
    the targets at positions s*N+1 .. (s+1)*N from the inputs s*N .. , so their contexts are
    1 .. N). A cut at or beyond the sequence's length is the whole-sequence score itself.

    The whole segments run as the rows of batched forwards (one forward for the window, or
    ``chunk // N`` rows at a time so that a forward holds no more tokens than a prefill chunk);
    a ragged last segment runs alone. A model scores each row of a batch on its own, so this is
    the per-segment loop's result (``tests/eval/test_ablation.py`` compares them), in a few
    large forwards instead of L / N small ones."""
    if max_context < 1:
        raise ValueError(f"max_context must be at least 1, got {max_context}")
    N, L = max_context, len(tokens) - 1
    if N >= L:
        return token_nll(model, tokens, chunk=chunk, token_map=token_map, device=device, on_chunk=on_chunk)
    ids = _model_ids(model, tokens, token_map, device)
    rows, targets, ragged = cut_segments(ids, N)
    whole = rows.shape[0]
    per_forward = whole if chunk is None else max(1, chunk // N)
    out = np.empty(L, dtype=np.float64)
    for r0 in range(0, whole, per_forward):
        r1 = min(r0 + per_forward, whole)
        logits = model(rows[r0:r1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[r0:r1].flatten(), reduction="none")
        out[r0 * N:r1 * N] = nll.double().cpu().numpy()
        if on_chunk is not None:
            on_chunk((r1 - r0) * N)
    if ragged < L:  # the ragged last segment
        out[ragged:] = token_nll(model, tokens[ragged:], chunk=chunk, token_map=token_map, device=device,
                                 on_chunk=on_chunk)
    return out


def cut_segments(ids: torch.Tensor, max_context: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A sequence's ids [L + 1] in segments of ``max_context`` = N predicted tokens, as rows:
    the inputs and targets [S, N] of the S = L // N whole segments (segment s: inputs s*N ..
    s*N+N-1, targets one further) and where the ragged last segment's inputs start (S x N; L when
    there is none)."""
    N = max_context
    whole = (ids.shape[0] - 1) // N
    return ids[:whole * N].view(whole, N), ids[1:whole * N + 1].view(whole, N), whole * N


@torch.no_grad()
def score_split(model: GLM5Model, dataset, split: str, *, windows: list[int] | None = None,
                max_windows: int | None = None,
                chunk: int | None = None, token_map: torch.Tensor | None = None,
                device: torch.device | str | None = None, on_chunk=None, cache=None,
                max_context: int | None = None, read_only: bool = False) -> TokenScores:
    """Scores of every non-N target of the chosen windows (``windows``, else ``select_windows``
    with ``max_windows``); a window is always scored whole, from its first base. ``cache``
    (``eval.cache.WindowCache``): windows scored earlier are read from it, each newly scored
    one is written to it at once. ``max_context``: each target sees at most that many tokens
    (``token_nll_cut``); its ``context`` stays its offset in the window, so a cut score sits in
    the same bucket as the whole-window score of the same base. ``read_only``: every window must
    be read from ``cache`` (rank 0 of an evaluation over many ranks, after they scored it: a
    window scored here alone would wait for ranks that are not there)."""
    from genome_lm.data.loader import SplitReader

    reader = SplitReader(dataset, split)
    if windows is None:
        windows = select_windows(reader.windows, max_windows=max_windows)
    was_training = model.training
    model.eval()
    parts = []
    try:
        for w in windows:
            tokens = reader.tokens(w)
            soft = reader.softmask(w)
            nll = None if cache is None else cache.load(w, len(tokens) - 1)
            if nll is None and read_only:
                raise GenomeLMError(f"{cache.folder}: window {w}'s scores missing or unreadable right after the ranks "
                                    "scored it (a damaged disk?); run the evaluation again to score it again")
            if nll is None:
                kwargs = dict(chunk=chunk, token_map=token_map, device=device, on_chunk=on_chunk)
                nll = (token_nll(model, tokens, **kwargs) if max_context is None
                       else token_nll_cut(model, tokens, max_context, **kwargs))
                if cache is not None:
                    cache.store(w, nll)
            elif on_chunk is not None:  # a window read back counts as scored
                on_chunk(len(nll))
            parts.append(window_scores(w, tokens, soft, nll))
    finally:
        model.train(was_training)
    return TokenScores.concat(parts)


def window_scores(window: int, tokens: np.ndarray, softmask: np.ndarray, nll: np.ndarray) -> TokenScores:
    """One window's scores: ``nll`` [len(tokens) - 1] of every target, kept where the target is
    not N, each with its context (its offset in the window) and whether it is soft-masked."""
    context = np.arange(1, len(tokens), dtype=np.int64)
    keep = tokens[1:] != N
    return TokenScores(nll[keep], context[keep], np.full(int(keep.sum()), window, dtype=np.int64),
                       np.asarray(softmask[1:], dtype=bool)[keep])

