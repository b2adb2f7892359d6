"""Long-range recall probe: can the model copy a segment it saw d bases earlier?

Each trial builds two sequences that end in the same segment A (``segment`` bases) and differ
only in one earlier piece:

    repeat : [ lead ][ A ][ d bases of background D ][ A ]
    control: [ lead ][ C ][ d bases of background D ][ A ]      C: another segment, same length
                                                      ^^^ scored

and scores the final A by next-base cross-entropy (nats per base) in both. The *copy advantage*
CE(control) - CE(repeat) isolates the use of the first copy across d bases: the two sequences
are identical everywhere else. Pieces are drawn (seeded) from N-free stretches of real or demo
sequence (a prepared dataset's evaluation split), or uniform random bases when none is given.
The interval is a percentile bootstrap over trials.

The default sweep runs d = 64, 256, 1k, ... (x4) up to the largest d whose probe
(lead + 2 * segment + d bases) fits the model's window, and ends at that d: the window is the
longest training length of the run (``data.seq_len`` and its warm-up), else the window length of
the dataset the pieces come from, else unknown (then 4k).

This follows the protocol of recall-bench (PyPI; its default "native" control keeps the
background that really preceded D, ours puts a foreign segment there, so that both sequences
carry one out-of-place piece). When recall-bench is installed, ``run_recall_bench`` also runs
its own sweep through its ``CallableModel`` interface, with background from the same source, so
both numbers can be reported side by side.
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from genome_lm.data.manifest import Manifest
from genome_lm.data.tokenizer import A, C, G, N, T
from genome_lm.engine import quiet_megatron_import
from genome_lm.errors import GenomeLMError

from ..score import model_device, token_nll

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

LETTERS = {A: "A", C: "C", G: "G", T: "T", N: "N"}
LEAD = 64  # background bases before the first piece of every probe
FALLBACK_MAX_DISTANCE = 4096  # largest default distance when the window length is unknown


@dataclass
class RecallRow:
    distance: int
    trials: int
    ce_repeat: float
    ce_control: float
    advantage: float
    ci_low: float
    ci_high: float

    def to_json(self) -> dict:
        return asdict(self)


class SequencePool:
    """N-free stretches of genome-lm token ids to draw probe pieces from."""

    def __init__(self, stretches: list[np.ndarray]):
        self.stretches = [s for s in stretches if s.size]
        if not self.stretches:
            raise ValueError("no N-free sequence to draw probe pieces from")
        self.lengths = np.array([s.size for s in self.stretches])

    @classmethod
    def from_dataset(cls, dataset: str | Path, split: str = "eval", min_run: int = 4096) -> "SequencePool":
        """Every N-free run of at least ``min_run`` bases in the split's windows (uppercase: the
        soft-mask is not part of the token ids)."""
        from genome_lm.data.loader import SplitReader

        reader = SplitReader(dataset, split)
        runs, longest = [], 0
        for w in range(len(reader)):
            tokens = reader.tokens(w)
            bad = np.flatnonzero(tokens == N)
            edges = np.concatenate([[-1], bad, [tokens.size]])
            for a, b in zip(edges[:-1], edges[1:]):
                longest = max(longest, int(b - a - 1))
                if b - a - 1 >= min_run:
                    runs.append(tokens[a + 1:b].astype(np.int64))
        if not runs:
            raise GenomeLMError(f"{dataset}: split {split!r} has no N-free stretch of at least {min_run:,} bases to "
                                f"draw probe pieces from ({len(reader)} windows, longest stretch {longest:,} bases)")
        return cls(runs)

    @classmethod
    def random(cls, length: int, seed: int) -> "SequencePool":
        rng = np.random.default_rng(seed)
        return cls([rng.choice(np.array([A, C, G, T]), size=length)])

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n contiguous bases from one stretch, or stretches joined end to end when none is long enough."""
        ok = np.flatnonzero(self.lengths >= n)
        if ok.size:
            s = self.stretches[int(rng.choice(ok))]
            start = int(rng.integers(0, s.size - n + 1))
            return s[start:start + n]
        parts, got = [], 0
        while got < n:
            parts.append(self.stretches[int(rng.integers(len(self.stretches)))])
            got += parts[-1].size
        return np.concatenate(parts)[:n]


def probe_sequences(pool: SequencePool, rng: np.random.Generator, distance: int, segment: int, lead: int):
    """(repeat, control, first scored index) token arrays of one trial."""
    seg_a, seg_c = pool.draw(rng, segment), pool.draw(rng, segment)
    lead_bg, gap = pool.draw(rng, lead), pool.draw(rng, distance)
    repeat = np.concatenate([lead_bg, seg_a, gap, seg_a])
    control = np.concatenate([lead_bg, seg_c, gap, seg_a])
    return repeat, control, lead + segment + distance


def copy_probe(model: GLM5Model, pool: SequencePool, distances: list[int], *, segment: int = 256, lead: int = LEAD,
               trials: int = 8, seed: int = 0, chunk: int | None = None, token_map=None, resamples: int = 1000,
               on_trial=None, on_row=None, budget_s: float | None = None) -> list[RecallRow]:
    """Copy advantage per distance (nats per base) with a 95% bootstrap interval over trials.
    ``on_row(row)`` is called as each distance finishes. ``budget_s``: stop before a distance
    that would end past this many seconds (its time predicted from the last distance's, in
    proportion to the probe length); the distances run are the rows returned."""
    rows = []
    start = time.perf_counter()
    last = None  # (probe length, seconds) of the last distance
    for d in distances:
        if budget_s is not None and last is not None:
            predicted = last[1] * (lead + 2 * segment + d) / last[0]
            if time.perf_counter() - start + predicted > budget_s:
                break
        began = time.perf_counter()
        rng = np.random.default_rng([seed, d])
        rep, ctl = np.empty(trials), np.empty(trials)
        for i in range(trials):
            repeat, control, first = probe_sequences(pool, rng, d, segment, lead)
            scored = slice(first - 1, first - 1 + segment)  # nll[j] scores token j + 1
            rep[i] = token_nll(model, repeat, chunk=chunk, token_map=token_map)[scored].mean()
            ctl[i] = token_nll(model, control, chunk=chunk, token_map=token_map)[scored].mean()
            if on_trial is not None:
                on_trial(d, i)
        adv = ctl - rep
        boot = np.random.default_rng([seed, d, 1]).integers(0, trials, size=(resamples, trials))
        lo, hi = np.percentile(adv[boot].mean(1), [2.5, 97.5])
        rows.append(RecallRow(d, trials, float(rep.mean()), float(ctl.mean()), float(adv.mean()), float(lo), float(hi)))
        last = (lead + 2 * segment + d, time.perf_counter() - began)
        if on_row is not None:
            on_row(rows[-1])
    return rows


def default_distances(max_distance: int) -> list[int]:
    """64, 256, 1k, 4k, ... (x4) up to ``max_distance``."""
    out, d = [], 64
    while d <= max_distance:
        out.append(d)
        d *= 4
    return out


def largest_distance(window: int, segment: int, lead: int = LEAD) -> int:
    """The largest d whose probe (``lead + 2 * segment + d`` bases) fits in ``window``."""
    d = window - lead - 2 * segment
    if d < 1:
        raise ValueError(f"a {window:,}-base window leaves no room for the probe ({lead} lead bases and two "
                         f"{segment}-base segments); use a shorter --segment")
    return d


def window_distances(window: int, segment: int, lead: int = LEAD) -> list[int]:
    """The default sweep for a model with this window: 64, 256, 1k, ... (x4) below the largest
    distance that fits (:func:`largest_distance`), then that distance."""
    return sweep_to(largest_distance(window, segment, lead))


def sweep_to(last: int) -> list[int]:
    """64, 256, 1k, ... (x4) up to ``last``, ending at ``last`` itself."""
    out = default_distances(last)
    if not out or out[-1] != last:
        out.append(last)
    return out


def probe_window(config=None, dataset: str | Path | None = None) -> tuple[int | None, str]:
    """(window length, where it comes from) for the default sweep: the longest training length of
    a run's config (``data.seq_len`` and the ``data.seq_len_warmup`` lengths), else the window
    length of ``dataset``, else (None, why not)."""
    if config is not None:
        seq_len = config.data.seq_len
        longest = max([seq_len] + [length for _, length in config.data.seq_len_warmup])
        field = "data.seq_len" if longest == seq_len else "data.seq_len_warmup"
        return longest, f"the run's {field}"
    if dataset is not None:

        return int(Manifest.load(Path(dataset)).data["windows"]["window"]), f"the window length of dataset {dataset}"
    return None, "no run config and no dataset"


def recall_bench_available() -> bool:

    return importlib.util.find_spec("recall_bench") is not None


def run_recall_bench(model: GLM5Model, pool: SequencePool, distances: list[int], *, trials: int = 8, seed: int = 0,
                     segment: int = 256, chunk: int | None = None, token_map=None,
                     max_ctx: int | None = None) -> list[dict]:
    """recall-bench's own copy-advantage sweep through its ``CallableModel`` interface, with
    background drawn from ``pool`` (no download). Returns its rows (copy_advantage, stderr, ...).
    ``max_ctx``: the model's window; recall-bench skips the distances whose probe (it rounds the
    length up to a power of two) is longer."""
    import recall_bench as rb

    to_id = np.full(128, N, dtype=np.int64)
    for token, letter in LETTERS.items():
        to_id[ord(letter)] = token
    mapping = token_map.numpy() if token_map is not None else None

    def tokenize(text: str) -> list[int]:  # bases -> the model's ids
        ids = to_id[np.frombuffer(text.upper().encode(), dtype=np.uint8)]
        return (mapping[ids] if mapping is not None else ids).tolist()

    def logits_fn(ids_BT: torch.Tensor) -> torch.Tensor:  # on the model's device; recall-bench reads CPU logits
        ids = ids_BT.to(model_device(model))
        with torch.no_grad():
            if chunk is None or ids.shape[1] <= chunk:
                return model(ids).logits.float().cpu()
            from genome_lm.model.prefill import chunked_logits

            return torch.cat([lg.float().cpu() for _, lg in chunked_logits(model, ids, chunk)], 1)

    letters = np.full(256, ord("N"), dtype=np.uint8)
    for token, letter in LETTERS.items():
        letters[token] = ord(letter)
    background = rb.DNABackground.from_strings([letters[s].tobytes().decode() for s in pool.stretches])
    adapter = rb.CallableModel(logits_fn=logits_fn, tokenize=tokenize, causal=True, max_ctx=max_ctx or 1 << 30,
                               name="genome-lm", device="cpu")
    return rb.evaluate(adapter, distances=distances, seg=segment, trials=trials, seed=seed, background=background,
                       verbose=False)


@dataclass
class RecallRun:
    """What ``genome-lm recall`` found: the JSON document it wrote, the rows of its own probe and
    recall-bench's rows (None when not run)."""

    doc: dict
    rows: list[RecallRow]
    bench: list[dict] | None
    source: Path | None


def plan_distances(given: list[int] | None, cap: int | None, window: int | None, where: str,
                   segment: int) -> tuple[list[int], str]:
    """The distances to probe and a sentence saying where they came from: ``given``, else up to
    ``cap``, else up to the largest that fits the model's ``window``, else up to 4k."""
    if given:
        dists, note = given, "distances from --distances"
    elif cap is not None:
        dists, note = sweep_to(cap), f"distances up to --max-distance {cap:,}"
    elif window is not None:
        dists = window_distances(window, segment, LEAD)
        note = (f"distances up to {dists[-1]:,}, the largest whose probe ({LEAD} + 2 x {segment} + d bases) "
                f"fits the model's {window:,}-base window ({where})")
    else:
        dists = default_distances(FALLBACK_MAX_DISTANCE)
        note = (f"window length unknown ({where}): distances up to {FALLBACK_MAX_DISTANCE:,} only; set "
                "--max-distance to the model's window length for the full sweep")
    if window is not None and LEAD + 2 * segment + max(dists) > window:
        note += (f"; note: the longest probe ({LEAD + 2 * segment + max(dists):,} bases) exceeds the model's "
                 f"{window:,}-base window ({where})")
    return dists, f"{note}: {', '.join(f'{d:,}' for d in dists)}"


def run_recall(model: str, out: Path, *, dataset: Path | None = None, distances: list[int] | None = None,
               max_distance: int | None = None, trials: int = 8, segment: int = 256, chunk: int = 32768,
               seed: int = 0, recall_bench: bool = True, max_seconds: float = 120.0,
               say=print, on_row=None) -> RecallRun:
    """``genome-lm recall``: load ``model``, probe each distance within ``max_seconds`` (0: no
    limit), rewrite ``out`` (JSON, schema genome-lm.recall/1) as each distance finishes, then run
    recall-bench's own sweep at the same distances when it is installed and time is left.
    ``say(text)`` gets the notes, ``on_row(row)`` each distance's row."""

    from genome_lm.engine.parallel import parallel_context

    from ..models import load_model
    from ..report import atomic_write

    with quiet_megatron_import(), parallel_context() as pg:
        lm = load_model(model, pg, seed=seed)
        config = lm.config
        source = dataset or (Path(config.data.dataset) if config is not None else None)
        window, where = probe_window(config, source)
        dists, note = plan_distances(distances, max_distance, window, where, segment)
        say(note)
        split = config.data.eval_split if config is not None and dataset is None else "eval"
        pool = SequencePool.from_dataset(source, split, min_run=segment * 2) if source else \
            SequencePool.random(max(dists) * 4 + 4 * segment, seed)
        doc = {"schema": "genome-lm.recall/1", "model": model, "source": str(source) if source else "random",
               "segment": segment, "lead": LEAD, "trials": trials, "seed": seed, "window": window,
               "window_from": where, "distances_planned": dists, "complete": False, "rows": [],
               "recall_bench": None}

        def write() -> None:
            atomic_write(out, (json.dumps(doc, indent=1, default=str) + "\n").encode())

        def finished(row: RecallRow) -> None:
            doc["rows"].append(row.to_json())
            write()
            if on_row:
                on_row(row)

        began = time.perf_counter()
        budget = max_seconds or None
        rows = copy_probe(lm.model, pool, dists, segment=segment, lead=LEAD, trials=trials, seed=seed,
                          chunk=chunk, token_map=lm.token_map, on_row=finished, budget_s=budget)
        left = [d for d in dists if d not in {r.distance for r in rows}]
        if left:
            say(f"time budget {max_seconds:g} s reached: distances {', '.join(f'{d:,}' for d in left)} not run "
                f"(--max-seconds 0 runs every distance; --distances {left[0]} runs one)")
        doc["skipped_for_time"] = left
        bench = None
        if recall_bench and recall_bench_available():
            if budget is not None and time.perf_counter() - began > 0.5 * budget:
                doc["recall_bench"] = "skipped: over half the time budget spent (--max-seconds 0 runs it)"
                say(f"recall-bench {doc['recall_bench']}")
            else:
                done = [r.distance for r in rows]
                say(f"recall-bench's own sweep at {', '.join(f'{d:,}' for d in done)} ...")
                bench = run_recall_bench(lm.model, pool, done, trials=trials, seed=seed, segment=segment,
                                         chunk=chunk, token_map=lm.token_map, max_ctx=window)
                doc["recall_bench"] = bench
        doc["complete"] = not left
        write()
    return RecallRun(doc, rows, bench, source)
