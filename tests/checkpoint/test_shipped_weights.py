"""The weights shipped with the package (``genome_lm.weights``): every file matches its recorded
SHA-256, ``builtin:NAME`` resolves wherever a model is named and refuses a damaged copy, and the
shipped long-context model does what it is shipped for: it copies from earlier in the sequence,
where a fresh model of the same architecture does not."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from genome_lm import weights
from genome_lm.config import load_config
from genome_lm.digest import sha256_file
from genome_lm.errors import GenomeLMError


@pytest.mark.parametrize("name", list(weights.SHIPPED))
def test_shipped_files_match_their_recorded_sha256(name):
    folder = weights.ROOT / name
    recorded = weights.SHIPPED[name]
    actual = {file: sha256_file(folder / file) for file in recorded if (folder / file).is_file()}
    assert actual == recorded, f"update genome_lm/weights SHIPPED[{name!r}] to {actual} if the change is intended"
    on_disk = {p.name for p in folder.iterdir() if p.is_file()}
    assert on_disk == set(recorded) | {"RECIPE.md"}, "every shipped file is recorded (RECIPE.md is the readme)"
    assert weights.folder(name) == folder


def test_builtin_names_resolve_in_a_config():
    cfg = load_config("demo-finetune-cpu")
    assert Path(cfg.model.checkpoint) == weights.ROOT / "tiny-long"
    assert load_config("demo-cpu", ["model.checkpoint=runs/x"]).model.checkpoint == "runs/x"  # paths stay paths


def test_an_unknown_name_is_a_one_line_error():
    with pytest.raises(GenomeLMError, match=r"--set model.checkpoint: builtin:tiny-lon: no such shipped weights "
                                            r"\(shipped: builtin:tiny-long\)") as err:
        load_config("demo-cpu", ["model.checkpoint=builtin:tiny-lon"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_copy_is_refused_naming_the_file(tmp_path, monkeypatch, damage):
    copy = tmp_path / "tiny-long"
    shutil.copytree(weights.ROOT / "tiny-long", copy)
    monkeypatch.setattr(weights, "ROOT", tmp_path)
    assert weights.folder("tiny-long") == copy  # intact: accepted
    target = copy / "model-00001-of-00001.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[:-8]))
    else:
        target.unlink()
    words = "missing from" if damage == "delete" else "SHA-256 differs"
    with pytest.raises(GenomeLMError, match=f"{target}: {words}"):
        load_config("demo-finetune-cpu")


@pytest.fixture(scope="module")
def pg():
    from genome_lm.engine.parallel import parallel_context

    with parallel_context() as pg:
        yield pg


def test_the_shipped_model_copies_and_a_fresh_one_does_not(pg):
    """The copy probe (a 256-base segment repeated 256 bases later, against a control segment):
    the shipped model predicts the repeat far better; the same architecture freshly initialised
    does not. Random DNA: nothing but the copy can help."""
    from genome_lm.eval.models import load_model
    from genome_lm.eval.probes.recall import SequencePool, copy_probe

    pool = SequencePool.random(50_000, seed=7)
    shipped = load_model("builtin:tiny-long", pg)
    assert shipped.info.kind == "huggingface" and Path(shipped.info.path) == weights.ROOT / "tiny-long"
    assert shipped.info.shipped == "builtin:tiny-long"  # what reports and plot legends call it
    (row,) = copy_probe(shipped.model, pool, [256], trials=4, seed=3)
    assert row.advantage > 0.2 and row.ci_low > 0.1, row
    (fresh,) = copy_probe(load_model("preset:tiny-long", pg).model, pool, [256], trials=4, seed=3)
    assert abs(fresh.advantage) < 0.05 and np.isfinite(fresh.ce_repeat), fresh


def test_shipped_weights_are_named_by_their_builtin_name(tmp_path):
    """A report names the shipped weights ``builtin:NAME`` (the plot legend said "huggingface"),
    any other folder by its kind; a copy of the shipped files elsewhere is not the shipped weights."""
    from genome_lm.eval.report import _label
    from genome_lm.eval.schema import ModelInfo

    assert weights.shipped_name(weights.ROOT / "tiny-long") == "builtin:tiny-long"
    assert weights.shipped_name(str(weights.ROOT / "tiny-long") + "/") == "builtin:tiny-long"
    shutil.copytree(weights.ROOT / "tiny-long", tmp_path / "tiny-long")
    assert weights.shipped_name(tmp_path / "tiny-long") is None
    assert weights.shipped_name(weights.ROOT) is None
    models = {"baseline": ModelInfo(kind="huggingface", shipped="builtin:tiny-long"),
              "model": ModelInfo(kind="huggingface"), "tuned": ModelInfo(kind="checkpoint", step=40)}
    report = SimpleNamespace(models=models)
    assert _label(report, "baseline") == "baseline (builtin:tiny-long)"
    assert _label(report, "model") == "model (huggingface)"
    assert _label(report, "tuned") == "tuned (checkpoint step 40)"
