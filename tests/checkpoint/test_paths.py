"""What a path names (``genome_lm.checkpoint.paths.resolve``), on folders laid out by hand."""

from pathlib import Path

import pytest

from genome_lm.checkpoint.paths import resolve, training_checkpoint
from genome_lm.errors import GenomeLMError


def _run(root: Path, steps=(4, 8), latest=8) -> Path:
    for step in steps:
        folder = root / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text("{}")
    if latest is not None:
        (root / "checkpoints" / "latest").write_text(f"step-{latest:06d}\n")
    return root


def test_a_run_folder_names_its_latest_checkpoint_or_the_step_asked_for(tmp_path):
    run = _run(tmp_path / "run")
    found = resolve(run)
    assert (found.kind, found.checkpoint, found.run_dir) == ("run", run / "checkpoints" / "step-000008", run)
    assert resolve(run, step="step-000004").checkpoint == run / "checkpoints" / "step-000004"
    with pytest.raises(GenomeLMError, match="step-000005: no such checkpoint in the run .*step-000004, step-000008"):
        resolve(run, step="step-000005")


def test_a_checkpoint_folder_names_itself_and_its_run(tmp_path):
    run = _run(tmp_path / "run")
    folder = run / "checkpoints" / "step-000004"
    found = resolve(folder)
    assert (found.kind, found.checkpoint, found.run_dir) == ("checkpoint", folder, run)
    assert training_checkpoint(folder) == folder and training_checkpoint(run) == run / "checkpoints" / "step-000008"


def test_a_hugging_face_folder_has_no_training_checkpoint(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    found = resolve(tmp_path / "hf")
    assert (found.kind, found.checkpoint, found.run_dir) == ("huggingface", None, None)
    assert training_checkpoint(tmp_path / "hf") is None
    with pytest.raises(GenomeLMError, match="not a run folder .*step-000004"):
        resolve(tmp_path / "hf", step="step-000004")


def test_everything_else_is_a_one_line_error(tmp_path):
    with pytest.raises(GenomeLMError, match="no such model"):
        resolve(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GenomeLMError, match="not a run folder .checkpoints/., a checkpoint .meta.json. or a Hugging"):
        resolve(tmp_path / "empty")
    _run(tmp_path / "unfinished", steps=(4,), latest=None)
    with pytest.raises(GenomeLMError, match="without a finished checkpoint .*so no checkpoint to export"):
        resolve(tmp_path / "unfinished", what="checkpoint to export")
