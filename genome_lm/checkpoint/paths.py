"""What a path names, worked out in one place for finetune, eval and export.

A user points genome-lm at one of three things:

- a training run folder (``train.out_dir``, holding ``checkpoints/``): its latest checkpoint,
  or the one named by ``step``;
- one training checkpoint folder (``<run>/checkpoints/step-000040``, holding ``meta.json``);
- a Hugging Face glm5_next folder (``config.json`` + safetensors, e.g. from ``genome-lm export``).

``resolve`` says which, and where the checkpoint and its run are. The run-folder rules of
training live here too: the checkpoints a run folder holds, refusing to start a new run over
one, and the checkpoint a resumed run starts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from genome_lm.errors import GenomeLMError

from .training import CheckpointCorrupt, latest_checkpoint, verify

Kind = Literal["run", "checkpoint", "huggingface"]


@dataclass(frozen=True)
class ModelPath:
    kind: Kind
    path: Path  # as the user gave it
    checkpoint: Path | None = None  # the training checkpoint folder (run and checkpoint kinds)
    run_dir: Path | None = None  # the run folder it belongs to (run and checkpoint kinds)

    @property
    def is_training_checkpoint(self) -> bool:
        return self.checkpoint is not None


def is_training_checkpoint(path: Path) -> bool:
    return (Path(path) / "meta.json").is_file()


def is_run_folder(path: Path) -> bool:
    return (Path(path) / "checkpoints").is_dir()


def resolve(path: str | Path, *, step: str | None = None, what: str = "model") -> ModelPath:
    """What ``path`` names (see the module docstring). ``step``: a checkpoint name within a run
    folder (``step-000020``) instead of its latest. ``what`` words the errors ("model",
    "checkpoint to export", ...). Raises GenomeLMError for a missing path, a run folder without
    a finished checkpoint, or anything else."""
    path = Path(path)
    if not path.exists():
        raise GenomeLMError(f"{path}: no such {what} (a run folder, a checkpoint folder or a Hugging Face folder)")
    if is_training_checkpoint(path):
        return ModelPath("checkpoint", path, checkpoint=path, run_dir=path.parent.parent)
    if is_run_folder(path):
        if step is not None:
            folder = path / "checkpoints" / step
            if not folder.is_dir():
                raise GenomeLMError(f"{folder}: no such checkpoint in the run (it has "
                                    f"{', '.join(p.name for p in existing_checkpoints(path)) or 'none'})")
        else:
            folder = latest_checkpoint(path)
            if folder is None:
                raise GenomeLMError(f"{path}: a run folder without a finished checkpoint (no checkpoints/latest), "
                                    f"so no {what}")
        return ModelPath("run", path, checkpoint=folder, run_dir=path)
    if step is not None:
        raise GenomeLMError(f"{path}: not a run folder (no checkpoints/), so no checkpoint {step} in it")
    if (path / "config.json").is_file():
        return ModelPath("huggingface", path)
    raise GenomeLMError(f"{path}: not a run folder (checkpoints/), a checkpoint (meta.json) or a Hugging Face "
                        "model (config.json)")


def training_checkpoint(path: str | Path) -> Path | None:
    """The genome-lm training checkpoint ``path`` names (itself, or a run folder's latest), or
    None when it names none (a Hugging Face folder, or nothing yet: the caller's own error)."""
    path = Path(path)
    if is_training_checkpoint(path) or is_run_folder(path):
        return resolve(path, what="checkpoint to start from").checkpoint
    return None


def existing_checkpoints(out: str | Path) -> list[Path]:
    """The step folders of a run folder's checkpoints, oldest first."""
    root = Path(out) / "checkpoints"
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith((".partial", ".old")))


def check_run_folder(out: Path, *, resume: bool, resume_from, overwrite: bool) -> None:
    """Refuse to start a new run over an existing one, unless asked to (--overwrite)."""
    if resume or resume_from is not None or overwrite:
        return
    found = existing_checkpoints(out)
    if found:
        raise GenomeLMError(f"{out}: already holds a training run (checkpoints up to {found[-1].name}); continue it "
                            "with --resume, start a new run elsewhere with --set train.out_dir=<new folder>, or "
                            "replace it with --overwrite")


def resume_point(out: Path, resume_from) -> Path:
    """The checkpoint folder to resume from: ``resume_from`` (a checkpoint folder, or its name in
    the run's checkpoints) or the run's latest, verified; a damaged one is an error that names
    the newest intact checkpoint and how to resume from it."""
    if resume_from is not None:
        folder = Path(resume_from)
        if not folder.is_dir() and (Path(out) / "checkpoints" / str(resume_from)).is_dir():
            folder = Path(out) / "checkpoints" / str(resume_from)
        if not folder.is_dir():
            raise GenomeLMError(f"{resume_from}: not a checkpoint folder (expected e.g. {out}/checkpoints/step-000020)")
        verify(folder)
        return folder
    try:
        folder = latest_checkpoint(out)
        if folder is None:
            raise GenomeLMError(f"{out}: nothing to resume (no checkpoints/latest)")
        verify(folder)
        return folder
    except CheckpointCorrupt as err:
        intact = None
        for candidate in reversed(existing_checkpoints(out)):
            try:
                verify(candidate)
            except CheckpointCorrupt:
                continue
            intact = candidate
            break
        if intact is None:
            raise CheckpointCorrupt(f"{err}; no intact checkpoint is left in {Path(out) / 'checkpoints'}") from None
        raise CheckpointCorrupt(f"{err}; the newest intact checkpoint is {intact}: resume from it with "
                                f"--resume-from {intact}") from None
