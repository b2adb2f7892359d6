"""Does the prompt matter? Greedy continuation of a repeat whose first copy is in the prompt.

Each trial takes the recall probe's pair of sequences (``recall.probe_sequences``): a segment A
(``segment`` bases), ``d`` bases of background, then A again; the control has another segment C
where the first A was. The prompt ends ``cue`` bases into the second A:

    repeat : [ lead ][ A ][ d bases ][ A[:cue] ]  -> generate segment - cue bases greedily
    control: [ lead ][ C ][ d bases ][ A[:cue] ]

and the generated bases are compared with the rest of A: the identity (share of bases equal).
A model that reads its prompt copies A's continuation from the first copy (identity near 1); the
control shows what it makes of the cue alone (near chance, about 0.25-0.4 for DNA).
The interval is a percentile bootstrap over trials.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from genome_lm.data.tokenizer import tokenize

from ..generate import Sampling, generate
from .recall import LEAD, SequencePool, probe_sequences

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model


@dataclass
class ContinuationRow:
    distance: int
    trials: int
    repeat: float  # mean identity of the continuation with the first copy's
    repeat_ci: tuple[float, float]
    control: float  # the same without the first copy
    control_ci: tuple[float, float]

    def to_json(self) -> dict:
        return asdict(self)


def continuation_prompts(pool: SequencePool, rng: np.random.Generator, distance: int, segment: int, cue: int,
                         lead: int = LEAD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(repeat prompt, control prompt, the bases the repeat should continue with) of one trial."""
    if not 0 < cue < segment:
        raise ValueError(f"cue {cue} must be between 0 and the segment ({segment})")
    repeat, control, second = probe_sequences(pool, rng, distance, segment, lead)
    return repeat[:second + cue], control[:second + cue], repeat[second + cue:second + segment]


def _ci(values: np.ndarray, rng: np.random.Generator, resamples: int = 1000) -> tuple[float, float]:
    draws = values[rng.integers(0, len(values), (resamples, len(values)))].mean(1)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(lo), float(hi)


def continuation_probe(model: GLM5Model, pool: SequencePool, distances: list[int], *, segment: int = 256,
                       cue: int = 32, trials: int = 4, seed: int = 0, chunk: int = 32_768, token_map=None,
                       on_row=None) -> list[ContinuationRow]:
    """Identity of the greedy continuation with the repeat, per distance, and its control."""
    rows = []
    for d in distances:
        rng = np.random.default_rng([seed, d])
        scores = {"repeat": [], "control": []}
        for _ in range(trials):
            repeat, control, want = continuation_prompts(pool, rng, d, segment, cue)
            made = generate(model, [("repeat", repeat), ("control", control)],
                            Sampling(n_tokens=segment - cue, greedy=True), chunk=chunk, token_map=token_map, batch=2)
            for g in made:
                scores[g.name].append(float((tokenize(g.sequence.encode()) == want).mean()))
        rep, ctl = np.array(scores["repeat"]), np.array(scores["control"])
        row = ContinuationRow(d, trials, float(rep.mean()), _ci(rep, rng), float(ctl.mean()), _ci(ctl, rng))
        rows.append(row)
        if on_row:
            on_row(row)
    return rows
