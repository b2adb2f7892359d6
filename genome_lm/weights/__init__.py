"""Model weights that ship with the package, named ``builtin:<name>`` in ``model.checkpoint``.

``tiny-long``: the tiny architecture (same layers as GLM-5.3-Flash, about 0.3M parameters) after
the CPU long-context recipe, ``genome-lm demo --long``: it has learned to copy a sequence from its
earlier occurrence, up to a few thousand bases back. The default demo fine-tunes from it, so
that a demo of minutes can show a model that uses long context (the recipe takes about 25
minutes). Each folder is a Hugging Face glm5_next checkpoint, as ``genome-lm export`` writes it,
plus ``RECIPE.md``: the commands that rebuild it and the figures it was shipped with.

Every file's SHA-256 is recorded here, and checked each time the weights are named: a changed
or truncated file is an error, never a silently different starting model. To ship new weights,
rebuild them with the recipe, export them into the folder and update ``SHIPPED`` (the test in
tests/checkpoint/test_shipped_weights.py prints the new sums when they differ).
"""

from __future__ import annotations

from pathlib import Path

from genome_lm.digest import sha256_file
from genome_lm.errors import GenomeLMError

PREFIX = "builtin:"
ROOT = Path(__file__).resolve().parent

SHIPPED: dict[str, dict[str, str]] = {
    "tiny-long": {
        "config.json": "780674802680049a4b9f4db3d7536932eed8b99492b08b3dd2c3c79aab1093da",
        "model-00001-of-00001.safetensors": "707f39a8f69abd995d7d3724cd7b2ab126464d13971d9f588bde4d3746aa9663",
        "model.safetensors.index.json": "444aad7ebca2912a18e36e90ceb179533d1666de65782b89a01c0bf918758fc2",
    },
}


def folder(name: str) -> Path:
    """The verified folder of the shipped weights ``name``: every recorded file present with its
    recorded SHA-256. Raises GenomeLMError naming the file otherwise."""
    if name not in SHIPPED:
        raise GenomeLMError(f"{PREFIX}{name}: no such shipped weights (shipped: "
                            f"{', '.join(PREFIX + n for n in SHIPPED)})")
    root = ROOT / name
    for file, expected in SHIPPED[name].items():
        path = root / file
        if not path.is_file():
            raise GenomeLMError(f"{path}: missing from the shipped weights {PREFIX}{name} (reinstall genome-lm)")
        if sha256_file(path) != expected:
            raise GenomeLMError(f"{path}: SHA-256 differs from the one recorded for {PREFIX}{name} "
                                "(a damaged or replaced file; reinstall genome-lm)")
    return root


def shipped_name(path: str | Path) -> str | None:
    """``builtin:<name>`` when ``path`` is the folder of shipped weights, else None (for reports
    and plots: the shipped weights by the name a user gives them, not by their install path)."""
    try:
        resolved = Path(path).resolve()
    except OSError:
        return None
    for name in SHIPPED:
        if resolved == ROOT / name:
            return PREFIX + name
    return None


def resolve(checkpoint: str | None) -> str | None:
    """``model.checkpoint`` as a path: ``builtin:<name>`` becomes the shipped folder (verified);
    anything else is returned as it is."""
    if checkpoint is None or not checkpoint.startswith(PREFIX):
        return checkpoint
    return str(folder(checkpoint[len(PREFIX):]))
