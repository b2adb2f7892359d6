"""A small trained run on a scaled-down demo genome, shared by the evaluation tests."""

from pathlib import Path

import pytest

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
    prepare(PrepareRequest(fasta, root / "dataset", ("chr1",), ("chr22",), WindowSpec(WINDOW, WINDOW, "keep", 256, 0.5)),
            workers=1, quiet=True, cache_dir=root / "cache")
    cfg = load_config("demo-cpu", [f"data.dataset={root / 'dataset'}", f"train.out_dir={root / 'run'}",
                                   "train.steps=2", "data.seq_len=256", "train.save_every=2",
                                   "train.indexer_dense_steps=1"])
    with quiet_megatron_import():
        train(cfg, progress=False)
    return root
