"""A file's SHA-256, read in 1 MiB blocks (hashlib releases the GIL, so it can run in a thread
beside other work): the identity of a FASTA, a checkpoint file, a shipped weight."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
