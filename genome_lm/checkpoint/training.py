"""Training checkpoints: atomic, verifiable, resumable under any parallel layout, and never
unpickling anything beyond tensors and numbers.

A checkpoint is a folder ``<out>/checkpoints/step-000020/`` with
    model-r00000.safetensors   the pieces of the weights rank 0 writes (``sharded``: each tensor's
                               pieces are written once, by the lowest rank holding them, each
                               placed in the whole tensor)
    optim-r00000.safetensors   the same for the optimizer's per-parameter state (torch's AdamW on
                               the CPU path); megatron-core's distributed optimizer (GPU path)
                               keeps its per-rank ``optim-r00000.pt`` (tensors and numbers only,
                               read with weights_only=True), which resumes under its own layout
    state-r00000.json          RNG states, data-loader position, the optimizer's group settings
and ``meta.json`` (format 2: step, layout, config, the index of every tensor's pieces, the size
and SHA-256 of every file). Weights and the CPU optimizer's state load under any layout and world
size (``sharded``): resume on another split, evaluate or export in one process. A rank whose index
has no state file of its own (a run on more ranks than wrote it) takes rank 0's RNG state; the
data loader's position is global.

It is written into ``step-000020.partial/`` and renamed when every rank has finished, then
``latest`` is replaced atomically. A crash at any moment leaves the previous checkpoint and
``latest`` intact; a file that is truncated or altered fails its checksum with an error naming it.
Checkpoints of format 1 (one ``model-r*.safetensors`` per rank with its own tensors) still load:
under their own layout, or under any layout when one rank wrote them.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from genome_lm.digest import sha256_file
from genome_lm.engine.backend import on_gpu
from genome_lm.errors import GenomeLMError

from .sharded import (
    FORMAT,
    PieceReader,
    full_model_tensors,
    legacy_index,
    load_model_pieces,
    load_optimizer_pieces,
    model_boxes,
    model_tensors,
    optimizer_boxes,
    optimizer_groups,
    set_optimizer_groups,
    write_pieces,
)

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

LATEST = "latest"


class CheckpointCorrupt(GenomeLMError):
    pass


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """Every random generator a training step touches, as JSON-safe values."""
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": repr(random.getstate()),
        "numpy": json.loads(json.dumps(np.random.get_state(legacy=False), default=lambda a: a.tolist())),
    }
    if on_gpu():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    random.setstate(ast.literal_eval(state["python"]))
    np_state = dict(state["numpy"])
    np.random.set_state(np_state)
    if "cuda" in state and on_gpu():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def per_parameter(optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer behind ``optimizer`` when its state is per parameter (torch's AdamW, or
    genome-lm's CPU optimizer around it), so it can be stored in pieces; None for megatron-core's
    distributed optimizer, whose state is flat buffers of this rank's data-parallel shard."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "torch_optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def save_checkpoint(out: str | Path, step: int, model: GLM5Model, optimizer, state: dict,
                    meta: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the finished folder."""
    rank, world = _rank_world()
    root = Path(out) / "checkpoints"
    final = root / f"step-{step:06d}"
    partial = root / f"step-{step:06d}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    entries = [(t, box) for t, box in model_boxes(model).values()]
    torch_opt = per_parameter(optimizer) if optimizer is not None else None
    own_state = dict(state)
    if torch_opt is not None:
        entries += optimizer_boxes(model, torch_opt)
        own_state["optimizer_groups"] = optimizer_groups(torch_opt)
    before = set(partial.iterdir())
    index = write_pieces(partial, rank, entries)
    if optimizer is not None and torch_opt is None:
        torch.save(optimizer.state_dict(), partial / f"optim-r{rank:05d}.pt")
    (partial / f"state-r{rank:05d}.json").write_text(json.dumps({**own_state, "rng": rng_state()}))
    for path in set(partial.iterdir()) - before:  # this rank's files on disk before anyone renames the folder
        fsync_path(path)
    _barrier()
    if rank == 0:
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(partial.iterdir())}
        optim = "none" if optimizer is None else "pieces" if torch_opt is not None else "per-rank"
        (partial / "meta.json").write_text(json.dumps({"step": step, "world_size": world, "format": FORMAT,
                                                       "optimizer": optim, "files": files, **(meta or {}),
                                                       "tensors": index}, indent=1))
        fsync_path(partial / "meta.json")
        fsync_path(partial)
        old = final.with_name(final.name + OLD)
        if final.exists():  # re-saving a step: the old copy stays whole until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(final.name + "\n")
        fsync_path(tmp)
        os.replace(tmp, root / LATEST)
        fsync_path(root)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


OLD = ".old"  # a step folder being replaced by a new save of the same step


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to the disk, so that a rename after it survives a
    machine's crash, not only the process's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(out: str | Path) -> Path | None:
    pointer = Path(out) / "checkpoints" / LATEST
    if not pointer.exists():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    old = folder.with_name(folder.name + OLD)
    if not folder.is_dir() and old.is_dir():  # a re-save of this step stopped between its two renames
        os.replace(old, folder)
    if not folder.is_dir():
        raise CheckpointCorrupt(f"{pointer}: points at {folder.name}, which does not exist")
    return folder


def verify(folder: Path) -> dict:
    meta_file = folder / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointCorrupt(f"{meta_file}: unreadable ({exc})") from None
    for name, info in meta["files"].items():
        path = folder / name
        if not path.exists():
            raise CheckpointCorrupt(f"{path}: missing")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointCorrupt(f"{path}: {path.stat().st_size} bytes, expected {info['bytes']} (truncated?)")
        if _hashed(path) != info["sha256"]:
            raise CheckpointCorrupt(f"{path}: checksum mismatch (file altered or corrupt)")
    return meta


_HASHES: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> SHA-256: each file read once per process


def _hashed(path: Path) -> str:
    """``sha256_file(path)``, remembered for the file as it is (its size, modification time and
    inode): a resume verifies the checkpoint it picks and then loads it, and reads each file once."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(path)
    return _HASHES[key]


def weight_layout(layout: dict) -> dict:
    """The parallel sizes that decide which shards of the weights and optimizer state a rank's
    files hold (sequence parallel splits activations, the shared DSA selection work only)."""
    return {k: v for k, v in layout.items() if k not in ("sequence_parallel", "split_dsa_selection")}


def checkpoint_format(meta: dict) -> int:
    return int(meta.get("format", 1))


def reshards(meta: dict) -> bool:
    """Whether the checkpoint's weights load under any layout: format 2, or one rank wrote it."""
    return checkpoint_format(meta) >= FORMAT or meta.get("world_size", 1) == 1


def piece_reader(folder: Path, meta: dict) -> PieceReader:
    """A reader of the checkpoint's weights (format 2, or a one-rank checkpoint of format 1)."""
    if checkpoint_format(meta) >= FORMAT:
        if "tensors" not in meta:
            raise CheckpointCorrupt(f"{folder / 'meta.json'}: format {meta['format']} without a tensor index")
        return PieceReader(folder, meta["tensors"])
    if meta.get("world_size", 1) != 1:
        raise GenomeLMError(f"{folder}: written by {meta['world_size']} ranks in genome-lm's earlier per-rank format, "
                            "which loads only under the layout that wrote it; resume it there once (its next "
                            "checkpoint loads under any layout), or export it with that layout")
    return PieceReader(folder, legacy_index(folder, meta["files"]))


def _legacy_layout_check(folder: Path, meta: dict, layout: dict | None, world: int) -> None:
    why = "(a checkpoint of genome-lm's earlier per-rank format: resume with the layout that wrote it)"
    if meta["world_size"] != world:
        raise GenomeLMError(f"{folder}: written by {meta['world_size']} ranks, this run has {world} {why}")
    if layout is not None and "layout" in meta and weight_layout(meta["layout"]) != weight_layout(layout):
        raise GenomeLMError(f"{folder}: written with parallel layout {meta['layout']}, this run has {layout} {why}")


def load_checkpoint(folder: str | Path, model: GLM5Model, optimizer=None, layout: dict | None = None) -> dict:
    """Restore model, optimizer (unless None: weights only) and RNG states; returns the trainer's
    saved state dict. ``layout``: this run's parallel sizes. Weights and a per-parameter
    optimizer's state load under any layout; megatron-core's distributed optimizer state and
    checkpoints of the earlier format written by several ranks need the layout that wrote them."""
    folder = Path(folder)
    meta = verify(folder)
    rank, world = _rank_world()
    same_layout = (meta.get("world_size") == world and
                   (layout is None or "layout" not in meta or weight_layout(meta["layout"]) == weight_layout(layout)))
    if checkpoint_format(meta) < FORMAT and meta.get("world_size", 1) != 1:
        _legacy_layout_check(folder, meta, layout, world)
    _load_model(folder, meta, model, rank)
    own = folder / f"state-r{rank:05d}.json"
    state = json.loads((own if own.exists() else folder / "state-r00000.json").read_text())
    groups = state.pop("optimizer_groups", None)  # the same on every rank
    if optimizer is not None:
        _load_optimizer(folder, meta, model, optimizer, groups, same_layout, rank)
    set_rng_state(state.pop("rng"))
    return state


def _load_model(folder: Path, meta: dict, model, rank: int) -> None:
    """The weights into ``model``: from the pieces when the checkpoint reshards, else this rank's
    file of the earlier per-rank format."""
    _check_base(folder, meta, model)
    if not reshards(meta):
        _load_legacy_rank(folder, model, rank)
        return
    reader = piece_reader(folder, meta)
    try:
        load_model_pieces(reader, model)
    finally:
        reader.close()


def base_record(model) -> dict | None:
    """What an adapter checkpoint records of the frozen base it was trained on (None for a model
    without adapters): where it came from and its content digest (``sharded.content_digest``)."""
    digest = getattr(model, "base_digest", None)
    if digest is None:
        return None
    return {"checkpoint": getattr(model, "base_source", None), "digest": digest}


def _check_base(folder: Path, meta: dict, model) -> None:
    """Adapters load only onto the base they were trained on, and only into a model with adapters."""
    recorded, ours = meta.get("base"), base_record(model)
    if recorded is None and ours is None:
        return
    if recorded is None:
        raise GenomeLMError(f"{folder}: holds a whole model, not LoRA adapters, and this model has adapters "
                            "(peft.method=lora): load it without peft")
    if ours is None:
        raise GenomeLMError(f"{folder}: holds only LoRA adapters (base {recorded['checkpoint']}); load it through its "
                            "run's config, which rebuilds the base and adds them")
    if recorded["digest"] != ours["digest"]:
        raise GenomeLMError(f"{folder}: its adapters were trained on the base {recorded['checkpoint']} (digest "
                            f"{recorded['digest'][:12]}), and the base loaded now, {ours['checkpoint']}, differs "
                            f"(digest {ours['digest'][:12]}): load them onto the weights they were trained on")


def _load_optimizer(folder: Path, meta: dict, model, optimizer, groups: list[dict] | None, same_layout: bool,
                    rank: int) -> None:
    torch_opt = per_parameter(optimizer)
    kept = meta.get("optimizer", "per-rank" if checkpoint_format(meta) < FORMAT else "none")
    if kept == "pieces" and torch_opt is not None:
        reader = piece_reader(folder, meta)
        try:
            load_optimizer_pieces(reader, model, torch_opt)
        finally:
            reader.close()
        if groups is not None:
            set_optimizer_groups(torch_opt, groups, folder)
        return
    if kept == "per-rank" and same_layout:
        # to host memory first: a GPU rank's tensors are tagged with the device they were saved
        # from (cuda:<local rank> under torchrun, cuda:0 in a Ray actor), which need not exist
        # now; the optimizer copies them into its own tensors
        optimizer.load_state_dict(torch.load(folder / f"optim-r{rank:05d}.pt", weights_only=True,
                                             map_location="cpu"))
        return
    if kept == "per-rank":
        raise GenomeLMError(f"{folder}: its optimizer state (kept per rank) resumes only "
                            f"under the layout that wrote it ({meta.get('layout')} on {meta.get('world_size')} ranks); "
                            "its weights load under any layout: start a new run from it with "
                            f"--set model.checkpoint={folder}")
    raise GenomeLMError(f"{folder}: holds optimizer state {kept!r}, which this run's optimizer cannot take "
                        f"({type(optimizer).__name__})")


def load_weights(folder: str | Path, model: GLM5Model) -> None:
    """Copy the checkpoint's parameters (and MoE expert biases) into ``model`` under its own
    layout: weights only, no optimizer, trainer state or RNG. The caller verifies the folder."""
    folder = Path(folder)
    _load_model(folder, json.loads((folder / "meta.json").read_text()), model, _rank_world()[0])


def _load_legacy_rank(folder: Path, model: GLM5Model, rank: int) -> None:
    """This rank's file of a format-1 checkpoint written by several ranks (the same layout)."""
    tensors = load_file(str(folder / f"model-r{rank:05d}.safetensors"))
    own = dict(model_tensors(model))
    if tensors.keys() != own.keys():
        missing = sorted(own.keys() - tensors.keys())[:3]
        raise GenomeLMError(f"{folder}: parameters do not match the model (missing e.g. {missing})")
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value)


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every weight of a checkpoint at full size, by the name a one-process model gives it (layers
    and experts numbered as in the whole model): the flat state dict, whatever layout wrote it.
    Verifies the folder first. Holds the whole model in memory: for small models and tests
    (``genome-lm export`` streams instead)."""
    folder = Path(folder)
    meta = verify(folder)
    reader = piece_reader(folder, meta)
    try:
        return dict(full_model_tensors(reader))
    finally:
        reader.close()

