"""DNA generation from a prompt (``genome-lm generate``; issue 51).

The prompt is read once through chunked prefill (``model.prefill.Prefill``): the KDA layers end
with their fixed-size recurrent state, the DSA layers with their latent cache. Each new base is
then one more step of the same prefill, a single token through the model against those caches,
so a base costs about the same whatever the prompt's length (the DSA layers' attention reads
at most ``index_topk`` selected tokens; their indexer scores one pooled key per ``index_kpool``
tokens of the cache).

Sampling: the next-token distribution is restricted to A, C, G and T (the vocabulary's other
tokens are masked), then divided by ``temperature``, cut to the ``top_k`` most likely bases and to
the smallest set whose probability reaches ``top_p``, and drawn with a seeded generator (greedy:
the most likely base). ``logprob`` records, for every generated base, the model's own
log-probability of it over the whole vocabulary (before the restriction and the temperature):
what a full forward over prompt + generated sequence gives at that position.

Prompts of the same length run as one batch (rows of one prefill); prompts of other lengths run
in turn. One process (chunked prefill does not split the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from genome_lm.data.tokenizer import BASE_TOKENS, InvalidBaseError, tokenize
from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

BASES = "ACGT"


@dataclass(frozen=True)
class Sampling:
    n_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0: all four bases
    top_p: float = 1.0
    greedy: bool = False
    seed: int = 0

    def check(self) -> None:
        if self.n_tokens < 1:
            raise GenomeLMError(f"--n-tokens {self.n_tokens}: generate at least 1 base")
        if not 0 < self.top_p <= 1:
            raise GenomeLMError(f"--top-p {self.top_p}: must be in (0, 1]")
        if not self.greedy and not self.temperature > 0:
            raise GenomeLMError(f"--temperature {self.temperature}: must be above 0 (or use --greedy)")
        if not 0 <= self.top_k <= 4:
            raise GenomeLMError(f"--top-k {self.top_k}: must be 0 (all) to 4 (the bases A, C, G, T)")

    def words(self) -> str:
        if self.greedy:
            return f"greedy n={self.n_tokens}"
        return (f"n={self.n_tokens} temperature={self.temperature:g} top_k={self.top_k or 4} top_p={self.top_p:g} "
                f"seed={self.seed}")


@dataclass
class Generated:
    name: str
    prompt_length: int
    sequence: str  # the generated bases, A/C/G/T
    logprob: np.ndarray = field(repr=False)  # [n] the model's log-probability of each generated base


def prompt_tokens(name: str, text: bytes | str) -> np.ndarray:
    """A prompt's genome-lm token ids; an empty prompt or a character outside the FASTA alphabet
    (A C G T N, the IUPAC codes, either case) is a one-line error naming the prompt."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    raw = raw.replace(b"\n", b"").replace(b"\r", b"")
    if not raw:
        raise GenomeLMError(f"prompt {name}: empty")
    try:
        return tokenize(raw)
    except InvalidBaseError as err:
        raise GenomeLMError(f"prompt {name}: {chr(err.byte)!r} at position {err.offset + 1} is not a base "
                            "(A, C, G, T, N or an IUPAC code)") from None


def pick(scores: torch.Tensor, s: Sampling, rng: torch.Generator) -> torch.Tensor:
    """[B] indices 0-3 (A C G T) drawn by ``s`` from the bases' logits ``scores`` [B, 4] (fp32, CPU)."""
    if s.greedy:
        return scores.argmax(dim=-1)
    scores = scores / s.temperature
    if s.top_k:
        kth = scores.topk(s.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1:
        probs = scores.softmax(-1)
        order = probs.argsort(dim=-1, descending=True)
        sorted_p = probs.gather(1, order)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely bases
        drop = before >= s.top_p  # keep the smallest set whose mass reaches top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return torch.multinomial(scores.softmax(-1), 1, generator=rng)[:, 0]


@torch.no_grad()
def generate_batch(model: GLM5Model, prompts: list[np.ndarray], s: Sampling, *, chunk: int = 32_768,
                   token_map: torch.Tensor | None = None, rng: torch.Generator | None = None,
                   on_token=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Generate ``s.n_tokens`` bases after each of ``prompts`` (genome-lm ids, all the same
    length, one batch): [(generated genome-lm ids [n], log-probabilities [n])] in order."""
    from genome_lm.model.prefill import Prefill

    from .score import _model_ids

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("generate_batch: the prompts of one batch must have the same length")
    rng = rng or torch.Generator().manual_seed(s.seed)
    ids = torch.stack([_model_ids(model, p, token_map, None) for p in prompts])  # [B, L]
    columns = torch.tensor(BASE_TOKENS, dtype=torch.long)
    if token_map is not None:
        columns = token_map[columns]
    columns = columns.to(ids.device)
    prefill = Prefill(model, total_tokens=ids.shape[1] + s.n_tokens - 1)
    for start in range(0, ids.shape[1], chunk):
        logits = prefill(ids[:, start:start + chunk])
    B = ids.shape[0]
    out = torch.empty(B, s.n_tokens, dtype=torch.long)
    logprob = torch.empty(B, s.n_tokens, dtype=torch.float64)
    for k in range(s.n_tokens):
        last = logits[:, -1].float()  # [B, V]
        choice = pick(last[:, columns].cpu(), s, rng)  # only the four bases' logits leave the device
        token = columns[choice.to(columns.device)]  # model ids
        logprob[:, k] = torch.log_softmax(last.double(), dim=-1).gather(1, token[:, None])[:, 0].cpu()
        out[:, k] = torch.tensor(BASE_TOKENS)[choice]
        if on_token:
            on_token(B)
        if k + 1 < s.n_tokens:
            logits = prefill(token[:, None])
    return [(out[b].numpy().astype(np.uint8), logprob[b].numpy()) for b in range(B)]


def generate(model: GLM5Model, prompts: list[tuple[str, np.ndarray]], s: Sampling, *, chunk: int = 32_768,
             token_map: torch.Tensor | None = None, batch: int = 8, on_token=None) -> list[Generated]:
    """Every prompt's continuation, in the prompts' order: prompts of one length in batches of
    up to ``batch``, one seeded generator drawing the batches in that order."""
    s.check()
    rng = torch.Generator().manual_seed(s.seed)
    by_length: dict[int, list[int]] = {}
    for i, (_, tokens) in enumerate(prompts):
        by_length.setdefault(len(tokens), []).append(i)
    results: list[Generated | None] = [None] * len(prompts)
    for indices in by_length.values():
        for lo in range(0, len(indices), batch):
            part = indices[lo:lo + batch]
            made = generate_batch(model, [prompts[i][1] for i in part], s, chunk=chunk, token_map=token_map, rng=rng,
                                  on_token=on_token)
            for i, (tokens, logprob) in zip(part, made):
                text = "".join(BASES[t - BASE_TOKENS[0]] for t in tokens.tolist())
                results[i] = Generated(prompts[i][0], len(prompts[i][1]), text, logprob)
    return results
