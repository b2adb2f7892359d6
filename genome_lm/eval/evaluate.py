"""`genome-lm eval`: loss by preceding-context length on an evaluation chromosome.

    evaluate(EvalRequest(model="runs/demo-cpu", baseline="init", chrom="22", out=...))

1. Data: the evaluation split of a prepared dataset (``--dataset``, else the run's
   ``data.dataset``), limited to the windows of ``--chrom``; or ``--fasta``: the chromosome is
   prepared first (``genome-lm prepare`` into ``<out>/prepared``, reused on a re-run).
2. Models: ``--model`` and optionally ``--baseline`` (``models.load_model``), scored on exactly
   the same windows and tokens (``score.score_split``, chunked prefill with ``--chunk``). Each
   window's scores are kept in ``<out>/.scores`` as soon as they exist (``cache``), so an
   interrupted evaluation re-run with the same arguments scores only the windows it had not.
3. Report (``report``): overall, unmasked and soft-masked loss, per context bucket with
   bootstrap intervals over windows (over blocks of sequence when the windows overlap:
   ``buckets.bootstrap_units``), the relative change against the baseline, with
   ``--max-context`` the model against itself with its context cut (``ablation``; with a
   baseline, the baseline cut too, and the model's delta minus the baseline's), and for the
   demo genome the planted-copies analysis (``planted``). Written as JSON, CSV and PNG into
   ``--out``, and logged to MLflow beside the training run (same store and experiment, a child
   run of it) when the model came from one.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from genome_lm import __version__, weights
from genome_lm.data.demo_genome import planted_json_path
from genome_lm.data.manifest import Manifest
from genome_lm.data.names import canonical
from genome_lm.data.regions import parse_region
from genome_lm.data.windows import MAX_N_FRACTION, STUDY_WINDOW, WindowSpec
from genome_lm.engine import quiet_megatron_import
from genome_lm.engine.ray_job import run_on_ray
from genome_lm.errors import GenomeLMError
from genome_lm.progress import progress_bar
from genome_lm.tracking import Tracker

from . import ablation as abl
from . import report as rep
from .baselines import MarkovModel, baseline_scores, describe
from .buckets import bootstrap_units, default_edges, parse_edges
from .planted import distance_figure
from .schema import SCHEMA, SUBSETS, Bootstrap, Data, EvalReport, MlflowInfo, Settings
from .score import TokenScores


@dataclass
class EvalRequest:
    model: str
    out: Path
    baseline: str | None = None
    dataset: Path | None = None
    fasta: Path | None = None
    chrom: str | None = None
    split: str = "eval"
    window: int = STUDY_WINDOW  # with --fasta
    edges: list[int] | None = None  # default: buckets.default_edges(window length)
    bucket_text: str | None = None  # --buckets, parsed once the window length is known
    chunk: int | None = 32768
    max_windows: int | None = None
    max_n_fraction: float = MAX_N_FRACTION
    resamples: int = 1000
    seed: int = 0
    planted: Path | None = None  # default: <genome>.planted.json beside the dataset's FASTA
    max_contexts: list[int] | None = None  # context ablation: the model again with each cut (``ablation``)
    tracking: bool = True
    tracking_uri: str | None = None
    layout: dict | None = None  # ParallelSizes fields over many ranks (--set parallel.*); default: eval_layout


def _windows_of(split_windows, chrom: str | None, source: str) -> list[int]:
    """The windows of ``chrom``: a chromosome (any naming convention) or a region of one
    (``chr2:1,800,001-2,333,275``, 1-based, inclusive), whose windows must lie wholly inside it."""
    if chrom is None:
        return list(range(len(split_windows)))

    present = sorted({w.chrom for w in split_windows})
    region = parse_region(chrom, present)
    exact = [c for c in present if c == region.name]
    match = exact or [c for c in present if canonical(c) == canonical(region.name)]
    if len(match) != 1:
        raise GenomeLMError(f"{source}: no evaluation windows on chromosome {region.name!r}; "
                            f"present: {', '.join(present)}")
    end = float("inf") if region.end is None else region.end
    chosen = [i for i,
              w in enumerate(split_windows) if w.chrom == match[0] and region.start <= w.start and w.end <= end]
    if not chosen:
        raise GenomeLMError(f"{source}: no evaluation window lies wholly inside {chrom}")
    return chosen


def _prepare_fasta(req: EvalRequest, progress: bool) -> Path:
    from genome_lm.data.prepare import PrepareRequest, prepare

    if req.chrom is None:
        raise GenomeLMError(f"{req.fasta}: --fasta needs --chrom (the chromosome to evaluate)")
    result = prepare(PrepareRequest(Path(req.fasta), Path(req.out) / "prepared", train_chroms=(),
                                    eval_chroms=(req.chrom,), windows=WindowSpec(req.window, req.window)),
                     quiet=not progress)
    return result.out


def eval_layout(req: EvalRequest, world_size: int):
    """The parallel layout of an evaluation over ``world_size`` ranks: ``req.layout`` when given;
    else, for a training run or checkpoint, the layout it was trained with when the ranks can
    hold it; else data parallel only
    (each rank a whole model, the windows shared out)."""
    from genome_lm.engine.parallel import ParallelSizes

    if req.layout is not None:
        return ParallelSizes(**req.layout)
    if world_size > 1:

        from genome_lm.checkpoint import resolve

        try:
            found = resolve(weights.resolve(str(req.model)), what="model")
        except GenomeLMError:
            found = None
        if found is not None and found.checkpoint is not None:
            layout = json.loads((found.checkpoint / "meta.json").read_text()).get("layout")
            if layout:
                sizes = ParallelSizes(**layout)
                if world_size % (sizes.tp * sizes.cp * sizes.pp) == 0 and world_size % sizes.ep == 0:
                    return sizes
    return ParallelSizes()


def eval_heap(sizes) -> str:
    """The CPU heap policy of an evaluation: a split model scores each window in one forward, its
    memory growing with the window (1M tokens: GiBs a rank), so freed blocks go back to the
    system, as for training's ``memory.host_heap: return`` (a kept heap fragments to up to twice
    the live tensors, ``engine.allocator``); one rank's chunked prefill is bounded and keeps its
    heap."""
    from .parallel import split_model

    return "return" if split_model(sizes) else "keep"


@dataclass
class _Selection:
    """What ``evaluate`` scores: the dataset, its split, the windows and the bucket edges."""

    dataset: Path
    manifest: object  # data.manifest.Manifest
    split: object  # its split
    windows: list[int]
    window_length: int
    edges: list[int]

    @property
    def bases(self) -> int:
        """Bases with a target (each window's first has none): what the progress bars count."""
        return sum(self.split.windows[i].length - 1 for i in self.windows)


@dataclass
class Scored:
    """What an evaluation scored, on the same bases for every entry: each model's token scores
    (the baselines that need no model included), each ``--max-context`` cut's ({model: {N:
    scores}}), and the bootstrap units ((unit [N], count), what a unit is). The report
    summarises it; ``eval.pooled`` pools it over the folds of a study."""

    scores: dict[str, TokenScores]
    cuts: dict[str, dict[int, TokenScores]]
    units: tuple[np.ndarray, int]
    unit_name: str
    markov: MarkovModel | None = None  # the chain fitted on a training split (None: none to fit on)


def evaluate(req: EvalRequest, *, progress: bool = True, on_note=None) -> EvalReport | None:
    """Run the evaluation; returns the report (also written to ``req.out``).

    Over many ranks (torchrun, or ``eval_on_ray``: every rank calls this) the model is split by
    ``eval_layout`` and the windows shared out (``eval.parallel``); rank 0 writes the report and
    returns it, the other ranks return None. The steps: load the models, choose the windows,
    score every (model, context cut) job into its resumable cache, summarise, write and log."""
    done = evaluate_scored(req, progress=progress, on_note=on_note)
    return None if done is None else done[0]


def evaluate_scored(req: EvalRequest, *, progress: bool = True, on_note=None) -> tuple[EvalReport, Scored] | None:
    """``evaluate``, also returning what was scored (rank 0; None on the other ranks)."""
    import torch.distributed as dist

    from genome_lm.engine.parallel import parallel_context

    from .models import load_model

    out = Path(req.out)
    started_ms = int(datetime.datetime.now(datetime.timezone.utc).timestamp() * 1000)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    sizes = eval_layout(req, world)
    with quiet_megatron_import(), parallel_context(sizes, host_heap=eval_heap(sizes)) as pg:
        rank = dist.get_rank()
        note = (on_note or (lambda text: None)) if rank == 0 else (lambda text: None)
        progress = progress and rank == 0
        loaded = {"model": load_model(req.model, pg, sizes=sizes)}
        if req.baseline:
            loaded["baseline"] = load_model(req.baseline, pg, init_of=loaded["model"], sizes=sizes)
        chosen = _choose_windows(req, _dataset(req, loaded["model"], rank, world, progress))
        jobs = _jobs(req, loaded)
        _note_size(req, chosen, jobs, note)
        scored = _score(req, loaded, jobs, chosen, pg, sizes, world, note, progress)
    if rank != 0:
        return None
    everything = _with_baselines(req, loaded, jobs, scored, chosen, note)
    report = _summarize(req, loaded, everything, chosen, sizes, world)
    write_outputs(report, out)
    if req.tracking:
        report.mlflow = log_to_mlflow(report, out, loaded["model"], req.tracking_uri, note, started_ms)
        rep.write_json(report, out / "eval.json")
    return report, everything


MANY_WINDOWS = 16  # more, without --max-windows, and the run gets a hint (the demo's chr22: 55, 10 minutes here)


def _note_size(req: EvalRequest, chosen: _Selection, jobs: list, note) -> None:
    """Before long work, say how much there is and how to do less."""
    n = len(chosen.windows)
    if req.max_windows is not None or n <= MANY_WINDOWS:
        return
    bases = sum(chosen.split.windows[i].length for i in chosen.windows)
    note(f"scoring all {n:,} windows ({bases / 1e6:,.1f} Mbp) {len(jobs)} time{'s' if len(jobs) > 1 else ''} "
         f"({', '.join(label for label, *_ in jobs)}); --max-windows N scores N of them, evenly spaced")


def _dataset(req: EvalRequest, model, rank: int, world: int, progress: bool) -> Path:
    """The dataset to score: ``--dataset``, a FASTA prepared into the output folder (by rank 0,
    the others waiting), or the model's training run's dataset."""
    import torch.distributed as dist

    if req.fasta is not None:
        if rank == 0:
            _prepare_fasta(req, progress)
        if world > 1:
            dist.barrier()  # rank 0 prepared it
        return Path(req.out) / "prepared"
    if req.dataset is not None:
        return Path(req.dataset)
    if model.config is None:
        raise GenomeLMError("--dataset or --fasta is needed (the model is not a training run with a dataset)")
    return Path(model.config.data.dataset)


def _choose_windows(req: EvalRequest, dataset: Path) -> _Selection:
    """The split's windows on ``--chrom`` (at most ``--max-windows``, none with too many N) and
    the context buckets' edges."""

    from .score import select_windows

    manifest = Manifest.load(dataset)
    split = manifest.split(req.split)
    candidates = _windows_of(split.windows, req.chrom, str(dataset / "manifest.json"))
    chosen = select_windows([split.windows[i] for i in candidates], max_windows=req.max_windows,
                            max_n_fraction=req.max_n_fraction)
    windows = [candidates[i] for i in chosen]
    if not windows:
        raise GenomeLMError(f"{dataset}: no window of split {req.split!r} to evaluate (all have more than "
                            f"{req.max_n_fraction:.0%} N)")
    window_length = max(split.windows[i].length for i in windows)
    edges = req.edges or (parse_edges(req.bucket_text, window_length) if req.bucket_text
                          else default_edges(window_length))
    return _Selection(dataset, manifest, split, windows, window_length, edges)


def _jobs(req: EvalRequest, loaded: dict) -> list[tuple[str, str, int | None]]:
    """(label, model, cut): every model whole, then the model with each ``--max-context`` cut;
    with a baseline, it is cut too (how much more the model uses the far context than it did)."""
    jobs = [(name, name, None) for name in loaded]
    jobs += [(f"{name}, context cut to {N:,}", name, N) for name in ("model", "baseline") if name in loaded
             for N in sorted(set(req.max_contexts or []))]
    return jobs


def _score(req: EvalRequest, loaded: dict, jobs: list, chosen: _Selection, pg, sizes, world: int, note,
           progress: bool) -> dict:
    """Every job's token scores (rank 0; the other ranks score their share and return {}),
    through a cache per job that an interrupted run resumes from."""
    import torch.distributed as dist

    from .cache import WindowCache, score_key
    from .parallel import score_into_cache
    from .score import score_split

    many, rank, out = world > 1, dist.get_rank(), Path(req.out)
    caches = {}
    for label, name, cut in jobs:
        key = score_key(loaded[name].model, loaded[name].token_map, chosen.dataset, req.split, req.chunk,
                        {**vars(sizes), "world": world} if many else None)
        folder = f"{name}-{key}" if cut is None else f"{name}-cut{cut}-{key}"
        caches[label] = cache = WindowCache(out / ".scores" / folder)
        done = sum(cache.has(i) for i in chosen.windows)  # (which can be read back is decided in score_into_cache)
        if done:
            note(f"{label}: {done} of {len(chosen.windows)} windows already scored in {cache.folder} (an earlier, "
                 "interrupted run with the same model and settings): reusing them")
    scored = {}
    with progress_bar(quiet=not progress) as bar:
        for label, name, cut in jobs:
            task = bar.add_task(f"eval {label}", total=chosen.bases, unit="bp")
            lm = loaded[name]
            advance = functools.partial(bar.advance, task)
            if many:  # every rank scores; rank 0 gathers the scores into its cache
                score_into_cache(lm.model, chosen.dataset, req.split, chosen.windows, cache=caches[label], pg=pg,
                                 sizes=sizes, chunk=req.chunk, token_map=lm.token_map, max_context=cut,
                                 on_done=advance)
                if rank != 0:
                    continue
                advance = None  # read back from the cache: counted already
            scored[label] = score_split(lm.model, chosen.dataset, req.split, windows=chosen.windows, chunk=req.chunk,
                                        token_map=lm.token_map, on_chunk=advance, cache=caches[label],
                                        max_context=cut, read_only=many)
    return scored


def _with_baselines(req: EvalRequest, loaded: dict, jobs: list, scored: dict, chosen: _Selection, note) -> Scored:
    """The jobs' scores, with the baselines that need no model (uniform, the Markov chain fitted
    on a training split) scored on the same bases, and the bootstrap units."""
    scores = {name: scored[name] for name in loaded}
    markov = _fit_markov(chosen.manifest, chosen.dataset, loaded["model"].config, note)
    scores.update(baseline_scores(scores["model"], chosen.dataset, req.split, markov))
    cuts = {name: {cut: scored[label] for label, who, cut in jobs if cut is not None and who == name}
            for name in loaded}
    unit, n_units, unit_name = bootstrap_units(scores["model"], chosen.split.windows)
    return Scored(scores, cuts, (unit, n_units), unit_name, markov)


def _summarize(req: EvalRequest, loaded: dict, everything: Scored, chosen: _Selection, sizes,
               world: int) -> EvalReport:
    """The report from the scores: every model and the baselines that need none, by context
    bucket with intervals; the context ablation; the planted copies; the headline."""

    scores, cuts, (unit, n_units) = everything.scores, everything.cuts, everything.units
    results, comparison = rep.summarize(scores, chosen.edges, resamples=req.resamples, seed=req.seed,
                                        units=(unit, n_units))
    ablation = None
    if req.max_contexts:
        baseline = (scores["baseline"], cuts["baseline"]) if "baseline" in loaded else None
        ablation = abl.summarize(scores["model"], cuts["model"], chosen.edges, resamples=req.resamples,
                                 seed=req.seed, units=(unit, n_units), baseline=baseline)
    planted_path = req.planted or _planted_beside(chosen.manifest)
    planted = None
    if planted_path is not None:
        from .planted import analyse, load_planted

        planted = analyse({name: scores[name] for name in loaded}, chosen.split.windows, load_planted(planted_path),
                          resamples=req.resamples, seed=req.seed)
        planted.source = str(planted_path)
    windows = chosen.windows
    chroms = sorted({chosen.split.windows[i].chrom for i in windows})
    first = next(iter(scores.values()))
    report = EvalReport(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        genome_lm=__version__,
        data=Data(dataset=str(chosen.dataset), split=req.split, chrom=",".join(chroms),
                  source=chosen.manifest.data.get("source", {}).get("path"), windows=windows,
                  window_length=chosen.window_length, tokens=int(first.nll.size),
                  tokens_softmasked=int(first.softmasked.sum())),
        settings=Settings(chunk=req.chunk, edges=chosen.edges, max_n_fraction=req.max_n_fraction, ranks=world,
                          layout=dict(vars(sizes)),
                          bootstrap=Bootstrap(resamples=req.resamples, seed=req.seed, level=0.95,
                                              unit=everything.unit_name, units=n_units)),
        models={**{name: lm.info for name, lm in loaded.items()}, **describe(everything.markov)},
        results=results,
        comparison=comparison,
        ablation=ablation,
        planted=planted,
    )
    report.headline = rep.headline(report)
    return report


def _fit_markov(manifest, dataset: Path, config, note):
    """The Markov baseline fitted on a training split: the evaluation dataset's, else the training
    run's dataset (an evaluation of a FASTA prepared for eval only has none); None, said, when
    neither has one."""

    from .baselines import fit_markov

    candidates = [(dataset, manifest)]
    if config is not None and Path(config.data.dataset) != dataset:
        candidates.append((Path(config.data.dataset), None))
    for folder, found in candidates:
        try:
            if found is None:

                found = Manifest.load(folder)
            split = config.data.train_split if config is not None else "train"
            if not found.split(split).windows:
                continue
            return fit_markov(folder, split)
        except (GenomeLMError, ValueError, KeyError, OSError):
            continue
    note("Markov baseline: no training split to fit it on (in the dataset or the model's run); uniform only")
    return None


def _planted_beside(manifest) -> Path | None:

    source = manifest.data.get("source", {}).get("path")
    if not source:
        return None
    path = planted_json_path(Path(source))
    return path if path.is_file() else None


def write_outputs(report: EvalReport, out: Path) -> None:
    """eval.json, eval.csv, loss_by_context.png (and planted_copies.png), each atomically."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    files = {"json": str(out / "eval.json"), "csv": str(out / "eval.csv"), "plot": str(out / "loss_by_context.png")}
    if report.planted:
        files["planted_plot"] = str(out / "planted_copies.png")
    if report.ablation:
        files["ablation_plot"] = str(out / "context_ablation.png")
    report.files = files
    rep.write_figure(rep.loss_figure(report), out / "loss_by_context.png")
    if report.ablation:
        rep.write_figure(abl.figure(report), out / "context_ablation.png")
    if report.planted:
        rep.write_figure(distance_figure(report.planted), out / "planted_copies.png")
    rep.write_csv(report, out / "eval.csv")
    rep.write_json(report, out / "eval.json")


def metrics(report: EvalReport) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Flat metrics for MLflow: (named values, [(name, value, step = bucket start)] series)."""
    flat, series = {}, []
    for name, entry in report.results.items():
        for subset in SUBSETS:
            for unit in ("nats", "bits"):
                if (value := getattr(getattr(entry, subset), unit)) is not None:
                    flat[f"eval/{name}/{subset}_{unit}"] = value
        for b in entry.buckets:
            if b.tokens and b.nats is not None:
                flat[f"eval/{name}/nats_ctx_{b.start}_{b.end}"] = b.nats
                series.append((f"eval/{name}/nats_by_context", b.nats, b.start))
    comparison = report.comparison
    if comparison:
        for subset in SUBSETS:
            if (value := getattr(comparison, subset).change) is not None:
                flat[f"eval/change/{subset}"] = value
        for b in comparison.buckets:
            if b.change is not None:
                flat[f"eval/change/ctx_{b.start}_{b.end}"] = b.change
                series.append(("eval/change/by_context", b.change, b.start))
    if report.ablation:
        more, more_series = abl.metrics(report.ablation)
        flat.update(more)
        series += more_series
    if report.planted:
        for name, entry in report.planted.models.items():
            if entry.advantage is not None:
                flat[f"eval/{name}/planted_copy_advantage_nats"] = entry.advantage.nats
    return flat, series


def eval_run_name(report: EvalReport, lm, out: Path) -> str:
    """``eval chr22: demo-cpu step 40 (8 windows, vs init, cut to 256, in eval-chr22)``: the
    training run's config and step (else the model's kind and path), then what tells two
    evaluations of it apart in MLflow's list: the windows, the baseline, the context cuts and the
    output folder."""
    info = report.models["model"]
    step = f" step {info.step}" if info.step is not None else ""
    cfg = lm.config
    what = Path(cfg.source).stem if cfg is not None and cfg.source else info.path or info.kind
    parts = [f"{len(report.data.windows)} window{'s' if len(report.data.windows) != 1 else ''}"]
    if "baseline" in report.models:
        parts.append(f"vs {report.models['baseline'].kind}")
    if report.ablation:
        parts.append("cut to " + ", ".join(f"{cut.max_context:,}" for cut in report.ablation.cuts))
    parts.append(f"in {Path(out).name}")
    return f"eval {report.data.chrom}: {what}{step} ({', '.join(parts)})"


def log_to_mlflow(report: EvalReport, out: Path, lm, tracking_uri: str | None, note,
                  started_ms: int | None = None) -> MlflowInfo | None:
    """A run in the training run's MLflow store and experiment, tagged as its child (MLflow's
    ``mlflow.parentRunId``), with the settings, per-bucket metrics (also as a series whose step is
    the bucket's first context length) and the files as artifacts. Without a training run: a
    store in ``out``. The run starts when the evaluation started (``started_ms``), so its
    duration is the evaluation's."""

    cfg = lm.config
    run_dir = lm.run_dir if lm.run_dir is not None else out
    uri = tracking_uri or (cfg.tracking.uri if cfg is not None else None)
    experiment = cfg.tracking.experiment if cfg is not None else "genome-lm"
    with Tracker(uri, experiment=experiment, run_name=eval_run_name(report, lm, out), run_dir=run_dir,
                 start_time_ms=started_ms) as tracker:
        if not tracker.active:
            note("MLflow: tracking unavailable; the report files are complete without it")
            return None
        tags = {"genome_lm.kind": "eval", "genome_lm.eval_schema": SCHEMA}
        if lm.run_id:
            tags.update({"mlflow.parentRunId": lm.run_id, "genome_lm.training_run": lm.run_id})
        tracker.set_tags(tags)
        json = report.to_json()
        tracker.log_params({"data": json["data"] | {"windows": len(report.data.windows)},
                            "settings": json["settings"], "models": json["models"]})
        flat, series = metrics(report)
        tracker.log_metrics(flat)
        for name, value, step in series:
            tracker.log_metrics({name: value}, step=step)
        for path in report.files.values():
            tracker.log_artifact(path)
        return MlflowInfo(**tracker.info())


def eval_on_ray(request, *, address: str, workers: int, cpus_per_worker: int = 1, gpus: bool | None = None,
                progress: bool = True):
    """Run ``eval.evaluate.evaluate(request)`` on ``workers`` Ray actors (the model split by the
    request's layout, the windows shared out); returns rank 0's report."""


    sizes = eval_layout(request, workers)
    sizes.check(workers)  # before a cluster is asked for anything
    absolute = {f: (None if getattr(request, f) is None else Path(os.path.abspath(getattr(request, f))))
                for f in ("out", "dataset", "fasta", "planted")}
    def where(spec):  # a folder as an absolute path (actors do not share the driver's working folder)
        return spec if spec is None or ":" in str(spec) or str(spec) == "init" else os.path.abspath(spec)

    request = dataclasses.replace(request, model=where(request.model), baseline=where(request.baseline),
                                  layout=dict(vars(sizes)), **absolute)
    return run_on_ray("genome_lm.eval.evaluate:evaluate_rank", (request, progress), address=address, workers=workers,
                      cpus_per_worker=cpus_per_worker, gpus=gpus)


def evaluate_rank(payload, rank: int):
    """One Ray rank of ``eval_on_ray``: ``evaluate`` (rank 0 returns the report)."""
    request, progress = payload
    return evaluate(request, progress=progress and rank == 0)
