"""Shared fixtures: FASTA writers, random genomes, the real sequences in ../shared."""

from __future__ import annotations

import gzip
import os
import uuid
import zlib
from pathlib import Path

import numpy as np
import pysam
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_GENOMES = REPO.parent / "shared" / "data" / "genomes"

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# Ray >= 2.5x turns token authentication on for the clusters it starts and caches the token in
# each process: every cluster and driver of the test session shares one token, set before any
# test starts Ray, whatever ~/.ray/auth_token holds.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", uuid.uuid4().hex)

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through Triton's interpreter (slow: small shapes only).
    # Set here, before any test module imports triton (megatron-core does): triton reads it once.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist's workers start with COLUMNS=80 (LINES=24), which would fix the width of the CLI's
# rich console at import; the CLI tests set their own through CliRunner's env
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left():
    """Each module ends with torch.distributed torn down. A group left behind costs every later
    test: gloo groups keep threads that wake hundreds of times a second, and the suite once ran
    at a third of its speed from them (``tests/engine/test_parallel_context.py``)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("a test of this module left torch.distributed initialised (parallel_context or "
                    "init_distributed not undone)")


def pytest_configure(config):
    """The C kernels (genome_lm_kernels/cpu) build once per test session, before collection (some
    skip marks ask whether they build), into a temporary folder that child processes inherit,
    never into the user's ~/.cache."""
    import atexit
    import os
    import shutil
    import tempfile

    if "GENOME_LM_CACHE" not in os.environ:
        folder = tempfile.mkdtemp(prefix="genome-lm-cache-")
        os.environ["GENOME_LM_CACHE"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Index caches go to a temporary folder, never to the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


def shared_genome(name: str) -> Path:
    path = SHARED_GENOMES / name
    if not path.exists():
        pytest.skip(f"{path} not present (see ../shared/data/genomes/SOURCES.md)")
    return path


def random_sequence(rng: np.random.Generator, length: int) -> bytes:
    """Random bases with soft-masked stretches, N runs and the odd IUPAC code."""
    seq = rng.choice(np.frombuffer(b"ACGT", dtype=np.uint8), size=length)
    for _ in range(max(1, length // 400)):
        a = int(rng.integers(0, length))
        seq[a : a + int(rng.integers(1, 200))] |= 32  # lowercase
    for _ in range(max(1, length // 2000)):
        a = int(rng.integers(0, length))
        seq[a : a + int(rng.integers(1, 300))] = ord("N")
    iupac = np.frombuffer(b"RYSWKMBDHVnr", dtype=np.uint8)
    where = rng.integers(0, length, size=max(1, length // 5000))
    seq[where] = rng.choice(iupac, size=where.size)
    return seq.tobytes()


def write_fasta(
    path: Path, records: dict[str, bytes], width: int = 60, compression: str = "plain", crlf: bool = False
) -> Path:
    """Write ``records`` as FASTA; compression is 'plain', 'gzip' or 'bgzf'."""
    eol = b"\r\n" if crlf else b"\n"
    parts = []
    for name, seq in records.items():
        parts.append(b">" + name.encode() + b" description text" + eol)
        parts += [seq[i : i + width] + eol for i in range(0, len(seq), width)]
    text = b"".join(parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    if compression == "plain":
        path.write_bytes(text)
    elif compression == "gzip":
        path.write_bytes(gzip.compress(text))
    elif compression == "bgzf":
        plain = path.with_name(path.name + ".plain")
        plain.write_bytes(text)
        pysam.tabix_compress(str(plain), str(path), force=True)
        plain.unlink()
    else:
        raise ValueError(compression)
    return path


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
