"""A small trained run on a scaled-down demo genome, shared by the evaluation tests."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.config import load_config
from genome_lm.data.demo_genome import write_demo_genome
from genome_lm.data.prepare import PrepareRequest, prepare
from genome_lm.data.windows import WindowSpec
from genome_lm.engine import quiet_megatron_import

WINDOW = 1024


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """Demo genome at scale 0.02 (chr22: 40 kbp, 1 kbp windows), the tiny model trained 2 steps
    of 256 tokens: <root>/genome.fa, <root>/dataset, <root>/run."""
    from genome_lm.train.trainer import train

    root = tmp_path_factory.mktemp("eval-demo")
    fasta = write_demo_genome(root / "genome.fa", scale=0.02)
    prepare(PrepareRequest(fasta, root / "dataset", ("chr1",), ("chr22",), WindowSpec(WINDOW, WINDOW, "keep", 256,
                                                                                      0.5)),
            workers=1, quiet=True, cache_dir=root / "cache")
    cfg = load_config("demo-cpu", [f"data.dataset={root / 'dataset'}", f"train.out_dir={root / 'run'}",
                                   "train.steps=2", "data.seq_len=256", "train.save_every=2",
                                   "train.indexer_dense_steps=1"])
    with quiet_megatron_import():
        train(cfg, progress=False)
    return root


@pytest.fixture(scope="session")
def evaluated(demo_run, tmp_path_factory):
    """`genome-lm eval` of the run against its starting weights on 4 chr22 windows:
    (out folder, eval.json content, terminal output)."""
    out = tmp_path_factory.mktemp("eval-out") / "chr22"
    result = CliRunner().invoke(app, ["eval", "--model", str(demo_run / "run"), "--baseline", "init",
                                      "--chrom", "22", "--chunk", "256", "--max-windows", "4", "--resamples", "200",
                                      "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "eval.json").read_text()), result.output


@pytest.fixture
def model():
    """The tiny preset, seeded, one process, the torch kernels: for the per-base tracks and
    embeddings tests (a test module may define its own)."""
    import torch

    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model

    with parallel_context() as pg:
        torch.manual_seed(3)
        yield build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()
