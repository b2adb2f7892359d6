"""`genome-lm score` over two ranks (torchrun, gloo): tensor (with sequence parallel), context,
expert, pipeline (layer 1 on the first stage, the final norm on the second) and data parallel give
the one-process tracks and embeddings (1e-5 relative), every base once and in order; rank 0 alone
writes the outputs."""

import os
import subprocess
import sys

import numpy as np
import pytest

from genome_lm.engine.parallel import free_port
from genome_lm.eval.embeddings import read_embeddings

pytestmark = pytest.mark.slow  # two ranks per layout

ARGS = ["--model", "builtin:tiny-long", "--regions", "chrA,chrB:51-700", "--window", "300", "--context", "100",
        "--chunk", "0", "--probs", "--embeddings", "1,final", "--embedding-dtype", "float32", "--quiet"]


@pytest.fixture(scope="module")
def genome(tmp_path_factory):
    from tests.conftest import random_sequence, write_fasta

    rng = np.random.default_rng(11)
    folder = tmp_path_factory.mktemp("genome")
    return write_fasta(folder / "g.fa", {"chrA": random_sequence(rng, 905), "chrB": random_sequence(rng, 700)})


@pytest.fixture(scope="module")
def one_process(genome, tmp_path_factory):
    from typer.testing import CliRunner

    from genome_lm.cli import app

    out = tmp_path_factory.mktemp("one") / "tracks"
    result = CliRunner().invoke(app, ["score", *ARGS, "--fasta", str(genome), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _torchrun(genome, out, sets: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "genome_lm", "score", *ARGS, "--fasta", str(genome),
           "--out", str(out), *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "COLUMNS": "200"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("layout", [{"tp": 2, "sequence_parallel": True}, {"cp": 2}, {"ep": 2}, {"pp": 2}, {}],
                         ids=["tp2-sp", "cp2", "ep2", "pp2", "dp2"])  # (TP 2 without SP: the same head, measured)
def test_two_ranks_give_the_one_process_tracks_and_embeddings(genome, one_process, tmp_path, layout):
    import pyarrow.parquet as pq

    out = tmp_path / "tracks"
    run = _torchrun(genome, out, [f"parallel.{k}={v}" for k, v in layout.items()])
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("scored 1,554 bases") == 1  # rank 0 alone reports: chrA from its 2nd base, chrB 51-700
    one, two = (pq.read_table(d / "tracks.parquet").to_pandas() for d in (one_process, out))
    assert list(two.chrom) == list(one.chrom) and list(two.pos) == list(one.pos) and list(two.ref) == list(one.ref)
    assert list(two.context) == list(one.context)
    np.testing.assert_allclose(two.loglik, one.loglik, rtol=1e-5, atol=1e-6)
    # the logits' fp32 rounding under another matmul split reaches 3e-5 of a probability at one base
    # of the 1,554 (TP 2 and CP 2: 2.1e-5 and 2.9e-5 of p_t at the same base, measured), and the
    # entropy of a peaked distribution 1e-5 nats
    for name in ("p_a", "p_c", "p_g", "p_t"):
        np.testing.assert_allclose(two[name], one[name], rtol=5e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(two.entropy, one.entropy, rtol=1e-5, atol=1e-5)
    for layer in ("layer_1", "final"):
        mine, theirs = (read_embeddings(d / "embeddings.zarr", layer) for d in (one_process, out))
        for (attrs_1, start_1, rows_1), (attrs_2, start_2, rows_2) in zip(mine, theirs, strict=True):
            assert attrs_1 == attrs_2 and np.array_equal(start_1, start_2)
            np.testing.assert_allclose(rows_2, rows_1, rtol=0, atol=1e-5 * np.abs(rows_1).max(), err_msg=layer)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in one_process.iterdir())
