import numpy as np
import pytest

from genome_lm.data.prepare import PrepareRequest, prepare
from genome_lm.data.windows import WindowSpec
from tests.conftest import random_sequence, write_fasta


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """A prepared dataset of random DNA with N runs and soft-masked stretches, windows of 1024."""
    rng = np.random.default_rng(7)
    root = tmp_path_factory.mktemp("train-data")
    records = {"chr1": random_sequence(rng, 9000), "chr2": random_sequence(rng, 5000),
               "chr22": random_sequence(rng, 3000)}
    fasta = write_fasta(root / "genome.fa", records)
    spec = WindowSpec(1024, 1024, "keep", min_tail=100, max_n_fraction=1.0)
    prepare(PrepareRequest(fasta, root / "ds", ("chr1", "chr2"), ("chr22",), spec), workers=1, quiet=True,
            cache_dir=root / "cache")
    return root / "ds"
