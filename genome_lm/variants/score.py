"""The model's log-likelihood of each allele, the shared context scored once.

A causal model's predictions before a variant do not depend on the allele. So for a site (the
variants that change the same first base) the preceding context runs once through the chunked
prefill (``model.prefill.Prefill``); its state is copied once per allele (``Prefill.fork``) and
only the positions the variant can change are scored: the allele's own bases and the following
context after it. Alleles whose continuations have the same length run as one batch. This gives
the same numbers as scoring every full window (``full_window_logprobs``, the reference the tests
and the benchmark compare with) up to rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model


def _ids(model: GLM5Model, tokens: np.ndarray, token_map: torch.Tensor | None) -> torch.Tensor:
    from genome_lm.eval.score import _model_ids

    return _model_ids(model, tokens, token_map, None)


@torch.no_grad()
def continuation_logprobs(model: GLM5Model, prefix: np.ndarray, continuations: list[np.ndarray], *,
                          token_map: torch.Tensor | None = None, chunk: int | None = None) -> list[np.ndarray]:
    """log p (nats, float64) of every token of each continuation, given ``prefix`` and the
    continuation's own earlier tokens: one array per continuation, of its length.

    ``prefix`` and the continuations are genome-lm token ids; the prefix (at least one token)
    runs once, in chunks of ``chunk`` tokens (all at once when None)."""
    from genome_lm.model.prefill import Prefill

    if len(prefix) < 1:
        raise ValueError("a variant needs at least one base of preceding context")
    if any(len(c) < 1 for c in continuations):
        raise ValueError("every continuation needs at least one token")
    longest = max(len(c) for c in continuations)
    # the selection layout of a full forward over the longest window (its inputs: all but the last token)
    prefill = Prefill(model, total_tokens=len(prefix) + longest - 1)
    ids = _ids(model, prefix, token_map)[None]
    step = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], step):
        last = prefill(ids[:, start:start + step])
    first = torch.log_softmax(last[0, -1].float(), dim=-1)  # predicts every continuation's first token
    out: list[np.ndarray | None] = [None] * len(continuations)
    by_length: dict[int, list[int]] = {}
    for i, c in enumerate(continuations):
        by_length.setdefault(len(c), []).append(i)
    for n, rows in by_length.items():
        ids_GN = torch.stack([_ids(model, continuations[i], token_map) for i in rows])
        lp = torch.empty(len(rows), n, dtype=torch.float64)
        lp[:, 0] = first[ids_GN[:, 0]].double()
        if n > 1:
            logits = prefill.fork(len(rows))(ids_GN[:, :-1])  # [G, n - 1, V]
            logp = torch.log_softmax(logits.float(), dim=-1)
            lp[:, 1:] = logp.gather(-1, ids_GN[:, 1:, None])[..., 0].double()
        for row, i in enumerate(rows):
            out[i] = lp[row].numpy()
    return out


@torch.no_grad()
def full_window_logprobs(model: GLM5Model, window: np.ndarray, *, token_map: torch.Tensor | None = None) -> np.ndarray:
    """log p of window[1:] each given the tokens before it, from one full forward (the reference
    the shared-prefix scoring is checked and benchmarked against)."""
    from genome_lm.eval.score import token_nll

    return -token_nll(model, window, token_map=token_map)
