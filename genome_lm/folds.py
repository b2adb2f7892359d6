"""The real-DNA study over k folds: ``genome-lm demo --fasta FILE --folds K --region R``.

One held-out stretch cannot carry a finding about real DNA: on four 500 kbp stretches the same
recipe gave a far-context gain above zero once and below zero three times. Here the region is
cut into K contiguous folds of (nearly) equal length; fold k is held out while the model is
tuned on the rest of the region, less a guard band of one window on each side of the held-out
fold (so no training window reaches within a window of a held-out base). Every base of the
region is held out exactly once, by a model that never saw it.

Each fold is the single-split study (``demo.run_dna_demo``) in ``OUT/fold-<k>``: its own
dataset, fine-tuning run and evaluation against its starting weights, the Markov chain fitted on
its training folds, and its context cut. A fold that is done is read back, one that was
interrupted continues (the trainer resumes from its last checkpoint, the evaluation from its
scored windows), so re-running the command finishes the study.

The report (``OUT/folds.json``, schema ``genome-lm.folds/1``) gives each fold's figures and the
pooled ones (``eval.pooled``: every base once, intervals stratified by fold), and for each
finding whether it holds (its interval on the claimed side of zero), is reversed (on the other
side) or is unclear, fold by fold and pooled, with a verdict in words: every fold, most, some,
none.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from genome_lm import __version__
from genome_lm.data.names import canonical
from genome_lm.data.regions import Region, parse_region
from genome_lm.demo import DNA_CONFIG, DNA_MAX_CONTEXTS, run_dna_demo
from genome_lm.errors import GenomeLMError
from genome_lm.eval.buckets import bootstrap_units
from genome_lm.eval.schema import Ablation, Beyond, Bootstrap, Comparison, Data, Delta, ModelResult, interval_side
from genome_lm.records import Document, from_json

FOLDS_SCHEMA = "genome-lm.folds/1"
BEATS_MARKOV = "the tuned model beats the Markov chain"  # a finding's claim, also read back by compare_recipes


@dataclass(frozen=True)
class FoldPlan:
    index: int  # 1-based
    held_out: Region
    train: tuple[Region, ...]


def plan_folds(region: Region, k: int, window: int, guard: int | None = None) -> list[FoldPlan]:
    """``region`` (bounded) cut into ``k`` contiguous folds; each fold's training regions are the
    rest of the region less ``guard`` bases (default one window) on each side of the fold."""
    guard = window if guard is None else guard
    if k < 2:
        raise GenomeLMError(f"--folds {k}: a k-fold study needs at least 2 folds")
    start, end = region.start, region.end
    bounds = [start + (end - start) * i // k for i in range(k + 1)]
    plans = []
    for i in range(k):
        a, b = bounds[i], bounds[i + 1]
        if b - a < window:
            raise GenomeLMError(f"region {region}: {k} folds of {b - a:,} bases are shorter than one window "
                                f"({window:,}); use fewer folds or a shorter --window")
        train = tuple(Region(region.name, lo, hi) for lo, hi in ((start, a - guard), (b + guard, end))
                      if hi - lo >= window)
        if not train:
            raise GenomeLMError(f"region {region}: fold {i + 1} leaves no training window once its guard bands "
                                f"({guard:,} bases) are left out; use a longer region or fewer folds")
        plans.append(FoldPlan(i + 1, Region(region.name, a, b), train))
    return plans


def bounded_region(fasta: Path, text: str, work: Path) -> Region:
    """``text`` (a chromosome or a region of one) as a bounded region of a record of ``fasta``."""
    from genome_lm.data.fasta import open_fasta

    source = open_fasta(Path(fasta), work, work)
    names = source.names()
    region = parse_region(text, names)
    match = [n for n in names if n == region.name] or [n for n in names if canonical(n) == canonical(region.name)]
    if len(match) != 1:
        raise GenomeLMError(f"{fasta}: no record {region.name!r} for --region; records: {', '.join(names[:10])}")
    return Region(match[0], region.start, region.end).bounded(source.length(match[0]), str(fasta))


# ----------------------------------------------------------------------------- the report


@dataclass(kw_only=True)
class FoldEntry:
    index: int
    held_out: str
    train: list[str]
    report: str  # the fold's eval.json
    units: int  # its bootstrap units (blocks of sequence)
    results: dict[str, ModelResult]
    comparison: Comparison | None
    ablation: Ablation | None


@dataclass(kw_only=True)
class Pooled:
    units: list[int]  # per fold
    results: dict[str, ModelResult]
    comparison: Comparison | None
    ablation: Ablation | None


@dataclass(kw_only=True)
class Finding:
    claim: str
    folds: list[str]  # per fold: holds, reversed, unclear, not measured
    pooled: str
    verdict: str


@dataclass(kw_only=True)
class FoldsReport(Document):
    schema: str = FOLDS_SCHEMA
    fasta: str
    region: str
    k: int
    window: int
    guard: int
    config: str
    overrides: list[str]
    drill: float = 0.0  # the share of training sequences from the copy drill (``--drill``)
    bootstrap: Bootstrap
    edges: list[int]
    folds: list[FoldEntry]
    pooled: Pooled
    findings: list[Finding]
    summary: list[str] = field(default_factory=list)


def _side(ci, above: bool) -> str:
    """holds / reversed / unclear for a claim that the interval ``ci`` lies above (or below) 0."""
    side = interval_side(ci)
    if side is None:
        return "not measured"
    if side == 0:
        return "unclear"
    return "holds" if (side == 1) == above else "reversed"


def outcomes(results: dict[str, ModelResult], comparison: Comparison | None, ablation: Ablation | None
             ) -> dict[str, str]:
    """Each claim of the study -> holds / reversed / unclear / not measured, from one report."""
    model = results["model"].all
    out = {}
    if "markov" in results and model.bits is not None:
        markov = results["markov"].all.bits
        out[BEATS_MARKOV] = _side((markov - model.bits_ci[1], markov - model.bits_ci[0])
                                                              if model.bits_ci[0] is not None else (None, None), True)
    if comparison is not None:
        out["fine-tuning lowers the loss against the starting weights"] = _side(comparison.all.ci, False)
    cut = ablation.cuts[0] if ablation and ablation.cuts else None
    if cut is not None and cut.beyond is not None:
        N, far = cut.max_context, cut.beyond.start
        out[f"the tuned model uses its context beyond {N:,} bases (bases with {far:,}+ of context)"] = \
            _side(cut.beyond.all.ci, True)
        if cut.gain is not None:
            for subset, words in (("all", "all bases"), ("unmasked", "unmasked bases"),
                                  ("softmasked", "soft-masked (repeat) bases")):
                out[f"the context beyond {N:,} is worth more to the tuned model than to its start ({words} with "
                    f"{far:,}+ of context)"] = _side(getattr(cut.gain.beyond, subset).ci, True)
    return out


def _verdict(per_fold: list[str]) -> str:
    k, holds, rev = len(per_fold), per_fold.count("holds"), per_fold.count("reversed")
    reversed_words = f"; reversed in {rev}" if rev else ""
    if holds == k:
        return f"holds in every fold ({k} of {k})"
    if holds > k / 2:
        return f"holds in most folds ({holds} of {k}{reversed_words})"
    if holds:
        return f"holds in some folds ({holds} of {k}{reversed_words})"
    return f"holds in no fold (0 of {k}{reversed_words})"


def findings(folds: list[FoldEntry], pooled: Pooled) -> list[Finding]:
    per_fold = [outcomes(f.results, f.comparison, f.ablation) for f in folds]
    everywhere = outcomes(pooled.results, pooled.comparison, pooled.ablation)
    out = []
    for claim, pooled_outcome in everywhere.items():
        marks = [o.get(claim, "not measured") for o in per_fold]
        out.append(Finding(claim=claim, folds=marks, pooled=pooled_outcome, verdict=_verdict(marks)))
    return out


def summary(report: FoldsReport) -> list[str]:
    """The study in words: the pooled figures, then each finding's verdict over the folds."""
    p = report.pooled
    model, start = p.results["model"].all, p.results["baseline"].all
    lines = [f"{report.k} folds of {report.region}, every base held out once (guard bands of {report.guard:,} "
             f"bases): tuned {model.bits:.4f} [{model.bits_ci[0]:.4f}, {model.bits_ci[1]:.4f}] bits/base, "
             f"its start {start.bits:.4f}"
             + (f", the Markov chains {p.results['markov'].all.bits:.4f}" if "markov" in p.results else "")]
    for f in report.findings:
        lines.append(f"{f.claim}: {f.verdict}; pooled: {f.pooled}")
    return lines


# ----------------------------------------------------------------------------- the run


def run_folds(out: Path, fasta: Path, region_text: str, k: int, window: int, *, config: str = DNA_CONFIG,
              overrides: list[str] | None = None, guard: int | None = None, max_contexts: list[int] | None = None,
              eval_windows: int | None = None, resamples: int = 1000, seed: int = 0, drill: float = 0.0,
              progress: bool = True, on_fold: Callable | None = None, on_dataset: Callable | None = None,
              on_trained: Callable | None = None) -> FoldsReport:
    """Run (or finish) every fold into ``out``/fold-<k>, then pool them into ``out``/folds.json.
    ``drill`` > 0 mixes the copy drill (prepared once in ``out``/drill) into every fold's
    training. ``on_fold(plan, k)`` is called as each fold starts."""
    from genome_lm.eval.pooled import pool
    from genome_lm.eval.report import write_json

    out = Path(out)
    region = bounded_region(fasta, region_text, out / ".fasta")
    plans = plan_folds(region, k, window, guard)
    _check_plan(out, fasta, plans, window, drill, recipe={"config": config, "overrides": list(overrides or []),
                                                          "max_contexts": list(max_contexts or DNA_MAX_CONTEXTS),
                                                          "eval_windows": eval_windows})
    done = []
    for plan in plans:
        if on_fold:
            on_fold(plan, k)
        result = run_dna_demo(out / f"fold-{plan.index}", fasta, tuple(str(r) for r in plan.train), str(plan.held_out),
                              window, config=config, overrides=overrides, eval_windows=eval_windows,
                              max_contexts=max_contexts or DNA_MAX_CONTEXTS, progress=progress,
                              on_dataset=on_dataset, on_trained=on_trained, drill=drill, drill_dir=out)
        done.append((plan, result))
    edges = done[0][1].report.settings.edges
    if any(r.report.settings.edges != edges for _, r in done):
        raise GenomeLMError(f"{out}: the folds' context buckets differ (windows of different lengths?)")
    results, comparison, ablation = pool([r.scored for _, r in done], edges, resamples=resamples, seed=seed)
    entries = [FoldEntry(index=plan.index, held_out=str(plan.held_out), train=[str(r) for r in plan.train],
                         report=str(r.report.files["json"]), units=r.scored.units[1], results=r.report.results,
                         comparison=r.report.comparison, ablation=r.report.ablation) for plan, r in done]
    pooled = Pooled(units=[e.units for e in entries], results=results, comparison=comparison, ablation=ablation)
    report = FoldsReport(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         genome_lm=__version__, fasta=str(fasta), region=str(region), k=k, window=window,
                         guard=window if guard is None else guard,
                         config=config, overrides=list(overrides or []), drill=drill,
                         bootstrap=Bootstrap(resamples=resamples, seed=seed, level=0.95,
                                             unit=done[0][1].scored.unit_name),
                         edges=edges, folds=entries, pooled=pooled, findings=findings(entries, pooled))
    report.summary = summary(report)
    write_json(report, out / "folds.json")
    return report


def _check_plan(out: Path, fasta: Path, plans: list[FoldPlan], window: int, drill: float,
                recipe: dict | None = None) -> None:
    """``out``/folds-plan.json records the folds and the recipe (config, --set overrides, context
    cuts, eval windows); a re-run must ask for the same (its fold folders hold their datasets,
    runs and scores: another recipe would mix two studies under the new one's name). A plan written
    before the recipe was recorded is taken for the folds alone and gains the recipe."""
    from genome_lm.eval.report import atomic_write

    path = out / "folds-plan.json"
    plan = {"fasta": str(Path(fasta).resolve()), "window": window, "drill": drill,
            "folds": [{"held_out": str(p.held_out), "train": [str(r) for r in p.train]} for p in plans],
            **({"recipe": recipe} if recipe is not None else {})}
    if path.exists():
        earlier = json.loads(path.read_text())
        if "recipe" not in earlier and recipe is not None:  # an older plan: the folds only
            earlier["recipe"] = recipe
            if earlier == plan:
                atomic_write(path, (json.dumps(plan, indent=1) + "\n").encode())
                return
        if earlier != plan:
            differ = [k for k in ("fasta", "window", "drill", "folds") if earlier.get(k) != plan.get(k)]
            differ += [k for k in (recipe or {}) if earlier.get("recipe", {}).get(k) != plan["recipe"][k]]
            raise GenomeLMError(f"{out} holds another k-fold study ({', '.join(differ)} differ: "
                                f"{len(earlier['folds'])} folds of {earlier['folds'][0]['held_out']}...; window "
                                f"{earlier['window']:,}; recipe {earlier.get('recipe')}); use another --out or "
                                "remove it")
        return
    atomic_write(path, (json.dumps(plan, indent=1) + "\n").encode())


# ----------------------------------------------------------------------------- reading and comparing studies


def read_folds(out: Path) -> FoldsReport:
    """The report of the study in ``out`` (its folder or its folds.json), checked; a one-line
    GenomeLMError naming the file otherwise."""
    out = Path(out)
    path = out / "folds.json" if out.is_dir() else out
    if not path.is_file():
        raise GenomeLMError(f"{path}: no k-fold report here (genome-lm demo --fasta FILE --folds K --region R "
                            f"--out {out} writes it)")
    try:
        return FoldsReport.from_json(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise GenomeLMError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    except ValueError as err:
        raise GenomeLMError(f"{path}: {err}") from None


def recipe(report: FoldsReport) -> str:
    """The study's recipe in words: its config, window, copy drill and overrides."""
    parts = [report.config, f"window {report.window:,}"]
    if report.drill:
        parts.append(f"copy drill {report.drill:g}")
    return ", ".join(parts + list(report.overrides))


@dataclass
class RecipeRow:
    """One study among several tried on the same folds: the far-context gain over the start
    beyond 2N per fold and pooled, and the tuned model against the Markov chain."""

    name: str
    recipe: str
    gains: list[Delta | None]  # per fold (None: not measured)
    pooled_gain: Delta | None
    gain_holds: int  # folds where the gain's interval lies above zero
    markov: list[str]  # per fold: holds / reversed / unclear for "the tuned model beats the Markov chain"
    tuned_bits: float
    markov_bits: float | None
    far: int  # the gain is over the bases with this much context or more (2N for a cut to N)


def _gain(ablation: Ablation | None) -> Delta | None:
    cut = ablation.cuts[0] if ablation and ablation.cuts else None
    return cut.gain.beyond.all if cut and cut.gain and cut.gain.beyond else None


def compare_recipes(studies: dict[str, FoldsReport]) -> list[RecipeRow]:
    """A row per study; the studies must hold out the same folds (same region, k and bounds),
    so that their figures are on the same bases."""
    (first_name, first), *others = studies.items()
    held = [f.held_out for f in first.folds]
    for name, report in others:
        if [f.held_out for f in report.folds] != held:
            raise GenomeLMError(f"{name} holds out other folds than {first_name} ({report.k} folds of "
                                f"{report.region} against {first.k} of {first.region}): their figures are on "
                                "different bases")
    cuts = {name: report.pooled.ablation.cuts[0] for name, report in studies.items()
            if report.pooled.ablation and report.pooled.ablation.cuts}
    if len(cuts) < len(studies):
        missing = next(name for name in studies if name not in cuts)
        raise GenomeLMError(f"{missing}: the study has no context cut, so no far-context gain to compare")
    if len({c.max_context for c in cuts.values()}) > 1:
        raise GenomeLMError("the studies cut the context at different lengths ("
                            + ", ".join(f"{name}: {c.max_context:,}" for name, c in cuts.items()) + ")")
    rows = []
    for name, report in studies.items():
        gains = [_gain(f.ablation) for f in report.folds]
        markov = next((f.folds for f in report.findings if f.claim == BEATS_MARKOV), ["not measured"] * report.k)
        pooled = report.pooled.results
        rows.append(RecipeRow(
            name=name, recipe=recipe(report), gains=gains, pooled_gain=_gain(report.pooled.ablation),
            gain_holds=sum(g is not None and _side(g.ci, True) == "holds" for g in gains), markov=markov,
            tuned_bits=pooled["model"].all.bits,
            markov_bits=pooled["markov"].all.bits if "markov" in pooled else None,
            far=cuts[name].beyond.start if cuts[name].beyond else 2 * cuts[name].max_context))
    return rows


@dataclass(kw_only=True)
class Share:
    """How much of the first study's loss drop from the start another study keeps, on a group of
    bases: ``share`` = (start - other) / (start - first), each a pooled sum of per-base losses, with
    a paired, fold-stratified 95% interval; None when the first study's own drop (``first_drop``,
    nats/base, with its interval) is not above zero, so that a share of it means nothing."""

    tokens: int
    first_drop: float
    first_drop_ci: tuple[float, float]
    other_drop: float
    share: float | None
    ci: tuple[float, float] | None


@dataclass
class RecipePair:
    """Study ``name``'s tuned models against study ``against``'s, on the same held-out bases,
    pooled over the folds with paired intervals: the change in loss ((name - against) / against,
    overall and by context bucket), how much more the context beyond the cut is worth to
    ``name``'s models than to ``against``'s (``gain``: all, unmasked and repeat bases), and the
    share of ``against``'s loss drop from the start that ``name`` keeps (``kept``: all bases, and
    those with ``far``+ of context)."""

    name: str
    against: str
    comparison: Comparison
    gain: Beyond  # over the bases with ``far``+ of context
    far: int
    kept: dict[str, Share] = field(default_factory=dict)  # "all", "far"


_MODEL_CACHE = re.compile(r"model-([0-9a-f]{16})")
_START_CACHE = re.compile(r"baseline-([0-9a-f]{16})")


def _complete(eval_dir: Path, pattern: re.Pattern, lengths: dict[int, int], cut: int | None) -> list:
    """The score caches of ``eval_dir`` named by ``pattern`` with every window of ``lengths``
    scored (and, with ``cut``, their cut twin too): per model, [whole] or [whole, cut], each
    {window: nll}."""
    from genome_lm.eval.cache import WindowCache

    complete = []
    for folder in sorted((eval_dir / ".scores").glob("*")):
        match = pattern.fullmatch(folder.name)
        if match is None:
            continue
        caches = [WindowCache(folder)]
        if cut is not None:
            caches.append(WindowCache(eval_dir / ".scores" / f"model-cut{cut}-{match.group(1)}"))
        loaded = [{w: c.load(w, n) for w, n in lengths.items()} for c in caches]
        if all(nll is not None for part in loaded for nll in part.values()):
            complete.append(loaded)
    return complete


def _tuned_scores(study: Path, entry: FoldEntry, cut: int, start: bool = False):
    """(whole, cut to ``cut``, the split's windows[, the start's scores]) of a fold's tuned model,
    read from its evaluation's score cache: every window its eval.json scored, from one model
    (and, with ``start``, from its starting weights: the evaluation's baseline)."""
    from genome_lm.data.loader import SplitReader
    from genome_lm.eval.score import TokenScores, window_scores

    fold = study / f"fold-{entry.index}"
    eval_dir = fold / "run" / "eval"
    path = eval_dir / "eval.json"
    if not path.is_file():
        raise GenomeLMError(f"{path}: missing (fold {entry.index} of {study} was not evaluated here)")
    try:
        data = from_json(Data, json.loads(path.read_text()).get("data"), "data")
    except (ValueError, AttributeError) as err:
        raise GenomeLMError(f"{path}: {err}") from None
    reader = SplitReader(fold / "dataset", data.split)
    lengths = {w: reader.windows[w].length - 1 for w in data.windows}

    def scores(part: dict) -> TokenScores:
        return TokenScores.concat([window_scores(w, reader.tokens(w), reader.softmask(w), nll)
                                   for w, nll in part.items()])

    complete = _complete(eval_dir, _MODEL_CACHE, lengths, cut)
    if len(complete) != 1:
        raise GenomeLMError(f"{eval_dir / '.scores'}: {'no' if not complete else len(complete)} tuned models with "
                            f"every window scored whole and cut to {cut:,} (expected one)")
    found = (*(scores(part) for part in complete[0]), reader.windows)
    if not start:
        return found
    starts = _complete(eval_dir, _START_CACHE, lengths, None)
    if len(starts) != 1:
        raise GenomeLMError(f"{eval_dir / '.scores'}: {'no' if not starts else len(starts)} starting models with "
                            "every window scored (expected one: the evaluation's baseline)")
    return (*found, scores(starts[0][0]))


def drop_share(start, first, other, unit: np.ndarray, weights: np.ndarray, keep: np.ndarray | None = None,
               level: float = 0.95) -> Share:
    """``Share`` of the loss drop start -> ``first`` that ``other`` keeps, over the bases ``keep``
    (all when None): per-base losses [N] of the same bases, ``unit`` [N] their bootstrap unit,
    ``weights`` [R, U] how often each resample draws each unit (``eval.pooled.stratified_weights``).
    Every resample takes the ratio of its own sums, so the interval is paired."""
    keep = np.ones(len(unit), bool) if keep is None else keep
    n_units = weights.shape[1]

    def per_unit(nll):
        return np.bincount(unit[keep], weights=nll[keep], minlength=n_units)

    s, f, o = per_unit(start), per_unit(first), per_unit(other)
    count = np.bincount(unit[keep], minlength=n_units).astype(np.float64)
    tokens = int(count.sum())
    first_drop, other_drop = (s - f).sum(), (s - o).sum()
    drawn_first = (weights @ (s - f)) / (weights @ count)
    lo_q, hi_q = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    first_ci = tuple(float(x) for x in np.percentile(drawn_first, [lo_q, hi_q]))
    share = ci = None
    if first_ci[0] > 0:  # the first study's drop is above zero in its interval: its share is defined
        share = float(other_drop / first_drop)
        ci = tuple(float(x) for x in np.percentile((weights @ (s - o)) / (weights @ (s - f)), [lo_q, hi_q]))
    return Share(tokens=tokens, first_drop=float(first_drop / tokens), first_drop_ci=first_ci,
                 other_drop=float(other_drop / tokens), share=share, ci=ci)


def pair_recipes(studies: dict[str, tuple[Path, FoldsReport]], *, resamples: int = 1000,
                 seed: int = 0) -> list[RecipePair]:
    """Every study after the first against the first (``compare_recipes``'s checks first): its
    tuned models' per-base scores against the first's, fold by fold, pooled (``eval.pooled``),
    and the share of the first's loss drop from the start that it keeps (``drop_share``; the
    studies must start from the same weights: their evaluations' baselines must agree)."""
    from genome_lm.eval.evaluate import Scored
    from genome_lm.eval.pooled import pool, stratified_weights

    rows = compare_recipes({name: report for name, (_, report) in studies.items()})
    cut = next(iter(studies.values()))[1].pooled.ablation.cuts[0].max_context
    (first, (first_dir, first_report)), *others = studies.items()
    theirs = [_tuned_scores(first_dir, entry, cut, start=True) for entry in first_report.folds]  # read once for all
    pairs = []
    for (name, (folder, report)), row in zip(others, rows[1:]):
        folds, parts = [], []
        for mine, (base, base_cut, _, start) in zip(report.folds, theirs):
            model, model_cut, windows, my_start = _tuned_scores(folder, mine, cut, start=True)
            if not model.same_tokens(base):
                raise GenomeLMError(f"{name} and {first}: fold {mine.index} was scored on other bases")
            if not np.allclose(my_start.nll, start.nll, rtol=1e-5, atol=1e-6):
                raise GenomeLMError(f"{name} and {first}: fold {mine.index}'s starting models score its bases "
                                    "differently (the studies start from other weights), so no share of one's loss "
                                    "drop can be taken")
            unit, n_units, unit_name = bootstrap_units(model, windows)
            folds.append(Scored({"model": model, "baseline": base},
                                {"model": {cut: model_cut}, "baseline": {cut: base_cut}}, (unit, n_units), unit_name))
            parts.append((unit, n_units, start, base, model))
        _, comparison, ablation = pool(folds, report.edges, resamples=resamples, seed=seed)
        weights = stratified_weights([n for _, n, *_ in parts], resamples, seed)
        offsets = np.cumsum([0] + [n for _, n, *_ in parts[:-1]])
        unit = np.concatenate([u + off for (u, *_), off in zip(parts, offsets)])
        start, base, model = (np.concatenate([p[i].nll for p in parts]) for i in (2, 3, 4))
        context = np.concatenate([p[4].context for p in parts])
        kept = {"all": drop_share(start, base, model, unit, weights),
                "far": drop_share(start, base, model, unit, weights, context >= row.far)}
        pairs.append(RecipePair(name=name, against=first, comparison=comparison, gain=ablation.cuts[0].gain.beyond,
                                far=row.far, kept=kept))
    return pairs
