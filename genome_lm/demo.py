"""The study end to end on the built-in demo genome, on this CPU (``genome-lm demo``).

demo genome -> prepare (chr1, chr2 train; chr22 eval) -> fine-tune the tiny model -> evaluate the
tuned against the starting model on the same chr22 windows. Re-running continues the demo's own
run (a finished one runs no step) and reuses the scored windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from genome_lm.config import RunConfig


@dataclass
class DemoResult:
    config: RunConfig
    trained: object  # train.trainer.TrainResult
    report: dict  # eval.json's content


def run_demo(out: Path, window: int, *, config: str = "demo-cpu", overrides: list[str] | None = None,
             eval_windows: int = 8, progress: bool = True, on_dataset: Callable | None = None,
             on_trained: Callable | None = None) -> DemoResult:
    """Run every stage into ``out``; ``on_dataset(prepare result)`` and ``on_trained(TrainResult)``
    are called as the stages finish."""
    from genome_lm.config import load_config
    from genome_lm.data.demo_genome import write_demo_genome
    from genome_lm.data.prepare import PrepareRequest, prepare
    from genome_lm.data.windows import WindowSpec
    from genome_lm.engine import quiet_megatron_import

    fasta = out / "genome.fa"
    if not fasta.exists():
        write_demo_genome(fasta)
    prepared = prepare(PrepareRequest(fasta, out / "dataset", windows=WindowSpec(window, window)), quiet=not progress)
    if on_dataset:
        on_dataset(prepared)
    cfg = load_config(config, [f"data.dataset={out / 'dataset'}", f"train.out_dir={out / 'run'}", *(overrides or [])])
    with quiet_megatron_import():
        from genome_lm.eval.evaluate import EvalRequest, evaluate
        from genome_lm.checkpoint import existing_checkpoints
        from genome_lm.train.trainer import train

        trained = train(cfg, progress=progress, resume=bool(existing_checkpoints(out / "run")))
        if on_trained:
            on_trained(trained)
        report = evaluate(EvalRequest(model=str(out / "run"), baseline="init", chrom="chr22",
                                      out=out / "run" / "eval-chr22", max_windows=eval_windows), progress=progress)
    return DemoResult(cfg, trained, report)
