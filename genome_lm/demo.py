"""The study end to end on the built-in demo genome, on this CPU (``genome-lm demo``).

demo genome -> prepare (chr1, chr2 train; chr22 eval) -> fine-tune the tiny model (by default the
shipped long-context model, ``builtin:tiny-long``; config ``demo-finetune-cpu``) -> evaluate the
tuned against the starting model on the same chr22 windows, and against itself with its context
cut to 256 bases. Re-running continues the demo's own run (a finished one runs no step) and reuses
the scored windows. ``run_long_demo`` is the recipe that built the shipped model; ``run_dna_demo``
is the same study on the user's own FASTA, with held-out regions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from genome_lm.data.demo_genome import DRILL_RECORD, CopyPlan, planted_json_path, write_demo_genome, write_drill
from genome_lm.data.windows import WindowSpec
from genome_lm.engine import quiet_megatron_import
from genome_lm.errors import Stopped, signal_exit_code

if TYPE_CHECKING:  # the CLI imports this module for DEMO_CONFIG: keep pydantic out of its start-up
    from genome_lm.config import RunConfig
    from genome_lm.eval.evaluate import Scored
    from genome_lm.eval.schema import EvalReport


@dataclass
class DemoResult:
    config: RunConfig
    trained: object  # train.trainer.TrainResult
    report: EvalReport  # eval.json's content
    scored: Scored | None = None  # the token scores it summarises (eval.evaluate.Scored)


DEMO_CONFIG = "demo-finetune-cpu"
DEMO_MAX_CONTEXTS = [256]  # the DSA layer's own budget (index_topk): what the context beyond it adds


def run_demo(out: Path, window: int, *, config: str = DEMO_CONFIG, overrides: list[str] | None = None,
             eval_windows: int = 8, progress: bool = True, on_dataset: Callable | None = None,
             on_trained: Callable | None = None) -> DemoResult:
    """Run every stage into ``out``; ``on_dataset(prepare result)`` and ``on_trained(TrainResult)``
    are called as the stages finish."""
    from genome_lm.data.prepare import PrepareRequest, prepare

    fasta = out / "genome.fa"
    if not fasta.exists():
        write_demo_genome(fasta)
    prepared = prepare(PrepareRequest(fasta, out / "dataset", windows=WindowSpec(window, window)), quiet=not progress)
    if on_dataset:
        on_dataset(prepared)
    evaluation = dict(chrom="chr22", out=out / "run" / "eval-chr22", max_windows=eval_windows,
                      max_contexts=DEMO_MAX_CONTEXTS)
    return _finetune_and_evaluate(out, config, overrides, evaluation, progress, on_trained)


DNA_CONFIG = "dna-finetune-cpu"
DNA_MAX_CONTEXTS = [1024]  # the ablation's cut on real DNA: 4x the DSA layer's own budget
# Held-out windows start every quarter window, so each held-out base is scored at four context
# lengths and every context bucket draws on the whole region, not on the same few stretches at
# the same offsets (on hg38 chr2's last 500 kbp, a GA-rich low-complexity stretch 256-1,024 bases
# into one of 16 disjoint windows decided which bucket gained most).
DNA_EVAL_STRIDES = 4


DNA_DRILL_BP = 4 << 20  # the copy drill mixed into real DNA (``--drill``): as long as the long recipe's


def prepare_drill(out: Path, window: int, progress: bool = True, on_dataset: Callable | None = None) -> Path:
    """The copy drill (``data.demo_genome.write_drill``, copies up to 16 kbp back) prepared in
    ``out``/drill as a training split of ``window``-base windows, once; returns the folder."""
    from genome_lm.data.prepare import PrepareRequest, prepare

    fasta = out / "drill.fa"
    if not fasta.exists():
        write_drill(fasta, DNA_DRILL_BP)
    prepared = prepare(PrepareRequest(fasta, out / "drill", (DRILL_RECORD,), (), WindowSpec(window, window)),
                       quiet=not progress)
    if on_dataset:
        on_dataset(prepared)
    return prepared.out


def drill_override(dataset: Path, fraction: float) -> str:
    """The ``--set`` item that mixes ``dataset`` into training as ``fraction`` of the sequences."""
    return "data.mix=" + json.dumps([{"dataset": str(dataset), "fraction": fraction}])


def run_dna_demo(out: Path, fasta: Path, train_regions: tuple[str, ...], eval_region: str, window: int, *,
                 config: str = DNA_CONFIG, overrides: list[str] | None = None, eval_windows: int | None = None,
                 max_contexts: list[int] | None = None, progress: bool = True, on_dataset: Callable | None = None,
                 on_trained: Callable | None = None, drill: float = 0.0, drill_dir: Path | None = None) -> DemoResult:
    """The study on the user's own FASTA (``genome-lm demo --fasta``): prepare ``train_regions``
    (chromosomes or samtools regions) for training and ``eval_region`` held out in windows that
    start every quarter window (``DNA_EVAL_STRIDES``), fine-tune (config ``dna-finetune-cpu``:
    from the shipped long-context model), then evaluate the tuned model on every held-out window
    (or ``eval_windows`` of them) against its starting weights,
    the Markov chain fitted on the training regions, uniform, and itself with its context cut
    (``max_contexts``, default 1,024 bases). ``drill`` > 0 mixes the copy drill into training as
    that fraction of the sequences (prepared once in ``drill_dir``, default ``out``; the Markov
    chain and the evaluation read the genome only). Re-running continues the run and reuses the
    scores."""
    from genome_lm.data.prepare import PrepareRequest, prepare

    prepared = prepare(PrepareRequest(Path(fasta), out / "dataset", tuple(train_regions), (eval_region,),
                                      WindowSpec(window, window), eval_stride=max(1, window // DNA_EVAL_STRIDES)),
                       quiet=not progress)
    if on_dataset:
        on_dataset(prepared)
    if drill:
        mixed = prepare_drill(drill_dir or out, window, progress, on_dataset)
        overrides = [*(overrides or []), drill_override(mixed, drill)]
    return _finetune_and_evaluate(out, config, overrides, dict(chrom=eval_region, out=out / "run" / "eval",
                                                               max_windows=eval_windows,
                                                               max_contexts=max_contexts or DNA_MAX_CONTEXTS),
                                  progress, on_trained)


def _finetune_and_evaluate(out: Path, config: str, overrides: list[str] | None, evaluation: dict, progress: bool,
                           on_trained: Callable | None) -> DemoResult:
    """Fine-tune ``config`` on ``out``/dataset into ``out``/run (continuing a run already there),
    then evaluate it against its starting weights (``evaluation``: the EvalRequest's other fields)."""
    from genome_lm.config import load_config

    cfg = load_config(config, [f"data.dataset={out / 'dataset'}", f"train.out_dir={out / 'run'}", *(overrides or [])])
    with quiet_megatron_import():
        from genome_lm.checkpoint import existing_checkpoints
        from genome_lm.eval.evaluate import EvalRequest, evaluate_scored
        from genome_lm.train.trainer import train

        trained = train(cfg, progress=progress, resume=bool(existing_checkpoints(out / "run")))
        if on_trained:
            on_trained(trained)
        _stop_if_stopped(trained)
        report, scored = evaluate_scored(EvalRequest(model=str(out / "run"), baseline="init", **evaluation),
                                         progress=progress)
    return DemoResult(cfg, trained, report, scored)


def _stop_if_stopped(trained) -> None:
    """A training stage that stopped early (a signal, non-finite losses) ends the demo: the
    next stage must not start from, or evaluate, an unfinished model."""
    if trained.stopped_by:
        raise Stopped(f"training in {trained.out_dir} stopped by {trained.stopped_by} at step "
                      f"{trained.steps_done}; run the same command again to continue it",
                      signal_exit_code(trained.stopped_by) or 1)


LONG_COPIES = dict(per_mbp=1000, length_bp=(64, 1000), distance_bp=(64, 16384), inversions=0.0)
LONG_DRILL_BP = 4 << 20
STAGE1_DRILL_DISTANCE = (64, 256)  # stage 1's drill copies from no further back than its 256-base crops
LONG_MAX_CONTEXTS = [256, 1024]  # the ablation's cuts: the DSA layer's own budget, and 4x it


@dataclass
class LongDemoResult:
    stages: list  # [TrainResult of stage 1 (drill), of stage 2 (genome + drill)]
    report: EvalReport  # eval.json of stage 2's model on chr22, with the context ablation
    selection: list  # eval.selection.SelectionCounts per DSA layer, on chr22


def run_long_demo(out: Path, *, overrides: tuple[list[str], list[str]] = ([], []), eval_windows: int = 8,
                  scale: float = 1.0, progress: bool = True, on_dataset: Callable | None = None,
                  on_trained: Callable | None = None) -> LongDemoResult:
    """The CPU long-context recipe into ``out``: the long demo genome (dense forward copies at
    64 bases to 16 kbp and a copy drill), stage 1 on a drill alone whose dispersed copies come
    from at most 256 bases back (config long-context-drill-cpu), stage 2 from it on genome +
    drill (long-context-cpu), then chr22: eval with the context cut to 256 and 1,024 bases, and
    how often the indexer selects a copy's source. ``overrides``: --set items for stage 1 and
    stage 2; ``scale``: the genome's (the drill's length too). Re-running continues each stage's
    run and reuses what was written."""
    from genome_lm.config import load_config
    from genome_lm.data.prepare import PrepareRequest, prepare

    fasta, drill_fasta = out / "genome.fa", out / "drill.fa"
    if not fasta.exists():
        write_demo_genome(fasta, scale=scale, copies=CopyPlan(**LONG_COPIES), drill_bp=round(LONG_DRILL_BP * scale))
    if not drill_fasta.exists():  # only its drill record is used: dispersed copies inside the crop
        write_demo_genome(drill_fasta, scale=scale, copies=CopyPlan(distance_bp=STAGE1_DRILL_DISTANCE),
                          drill_bp=round(LONG_DRILL_BP * scale))
    spec = WindowSpec(32768, 32768)
    datasets = [prepare(PrepareRequest(drill_fasta, out / "drill", ("drill",), (), spec), quiet=not progress),
                prepare(PrepareRequest(fasta, out / "dataset", ("chr1", "chr2", "drill"), ("chr22",), spec),
                        quiet=not progress)]
    for prepared in datasets:
        if on_dataset:
            on_dataset(prepared)
    configs = [load_config("long-context-drill-cpu", [f"data.dataset={out / 'drill'}",
                                                      f"train.out_dir={out / 'drill-run'}", *overrides[0]]),
               load_config("long-context-cpu", [f"data.dataset={out / 'dataset'}", f"train.out_dir={out / 'run'}",
                                                f"model.checkpoint={out / 'drill-run'}", *overrides[1]])]
    with quiet_megatron_import():
        from genome_lm.checkpoint import existing_checkpoints
        from genome_lm.eval.evaluate import EvalRequest, evaluate
        from genome_lm.train.trainer import train

        stages = []
        for cfg in configs:
            stages.append(train(cfg, progress=progress, resume=bool(existing_checkpoints(cfg.train.out_dir))))
            if on_trained:
                on_trained(stages[-1])
            _stop_if_stopped(stages[-1])
        report = evaluate(EvalRequest(model=str(out / "run"), chrom="chr22", out=out / "run" / "eval-chr22",
                                      max_windows=eval_windows, max_contexts=LONG_MAX_CONTEXTS), progress=progress)
        selection = _chr22_selection(out, configs[1].data.seq_len)
    return LongDemoResult(stages, report, selection)


def _chr22_selection(out: Path, length: int) -> list:
    """How often stage 2's indexer selects the source of a copied base, on two chr22 windows cut
    to ``length`` (the training length)."""
    from genome_lm.engine.parallel import parallel_context
    from genome_lm.eval.models import load_model
    from genome_lm.eval.planted import load_planted
    from genome_lm.eval.probes.selection import split_selection

    with parallel_context() as pg:
        loaded = load_model(out / "run", pg)
        return split_selection(loaded.model.eval(), out / "dataset", load_planted(planted_json_path(out / "genome.fa")),
                               chrom="chr22", max_windows=2, length=length, token_map=loaded.token_map)
