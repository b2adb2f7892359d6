"""Training checkpoints: atomic, verifiable, resumable, and never unpickling arbitrary objects.

A checkpoint is a folder ``<out>/checkpoints/step-000020/`` with, per rank r:
    model-r00000.safetensors   the rank's parameters (its tensor/expert-parallel shards)
    optim-r00000.pt            optimizer state (tensors and numbers only; read with weights_only=True)
    state-r00000.json          RNG states, data-loader position, anything else the trainer keeps
and ``meta.json`` (step, layout, config, the size and SHA-256 of every file). It is written into
``step-000020.partial/`` and renamed when every rank has finished, then ``latest`` is replaced
atomically. A crash at any moment leaves the previous checkpoint and ``latest`` intact; a file
that is truncated or altered fails its checksum with an error naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import base64
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from genome_lm.digest import sha256_file
from genome_lm.engine.backend import on_gpu
from genome_lm.errors import GenomeLMError

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
    import ast

    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    random.setstate(ast.literal_eval(state["python"]))
    np_state = dict(state["numpy"])
    np.random.set_state(np_state)
    if "cuda" in state and on_gpu():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def _model_tensors(model: GLM5Model) -> dict[str, torch.Tensor]:
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    tensors.update({n: b.detach().contiguous() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return tensors


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
    save_file(_model_tensors(model), str(partial / f"model-r{rank:05d}.safetensors"))
    torch.save(optimizer.state_dict(), partial / f"optim-r{rank:05d}.pt")
    (partial / f"state-r{rank:05d}.json").write_text(json.dumps({**state, "rng": rng_state()}))
    _barrier()
    if rank == 0:
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(partial.iterdir())}
        (partial / "meta.json").write_text(json.dumps({"step": step, "world_size": world, "files": files,
                                                       **(meta or {})}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / LATEST)
    _barrier()
    return final


def latest_checkpoint(out: str | Path) -> Path | None:
    pointer = Path(out) / "checkpoints" / LATEST
    if not pointer.exists():
        return None
    folder = pointer.parent / pointer.read_text().strip()
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
        if sha256_file(path) != info["sha256"]:
            raise CheckpointCorrupt(f"{path}: checksum mismatch (file altered or corrupt)")
    return meta


def weight_layout(layout: dict) -> dict:
    """The parallel sizes that decide which shards of the weights and optimizer state a rank's
    files hold (sequence parallel splits activations only)."""
    return {k: v for k, v in layout.items() if k != "sequence_parallel"}


def load_checkpoint(folder: str | Path, model: GLM5Model, optimizer=None, layout: dict | None = None) -> dict:
    """Restore model, optimizer (unless None: weights only) and RNG states; returns the trainer's
    saved state dict. ``layout``: this run's parallel sizes, which must be the checkpoint's."""
    folder = Path(folder)
    meta = verify(folder)
    rank, world = _rank_world()
    if meta["world_size"] != world:
        raise GenomeLMError(f"{folder}: written by {meta['world_size']} ranks, this run has {world} "
                            "(resume with the same layout, or export to Hugging Face format and start from that)")
    if layout is not None and "layout" in meta and weight_layout(meta["layout"]) != weight_layout(layout):
        raise GenomeLMError(f"{folder}: written with parallel layout {meta['layout']}, this run has {layout} "
                            "(resume with the same layout, or export to Hugging Face format and start from that)")
    load_weights(folder, model)
    if optimizer is not None:
        # to host memory first: a GPU rank's tensors are tagged with the device they were saved
        # from (cuda:<local rank> under torchrun, cuda:0 in a Ray actor), which need not exist
        # now; the optimizer copies them into its own tensors
        optimizer.load_state_dict(torch.load(folder / f"optim-r{rank:05d}.pt", weights_only=True,
                                             map_location="cpu"))
    state = json.loads((folder / f"state-r{rank:05d}.json").read_text())
    set_rng_state(state.pop("rng"))
    return state


def load_weights(folder: str | Path, model: GLM5Model) -> None:
    """Copy this rank's saved parameters (and MoE expert biases) into ``model``: weights only, no
    optimizer, trainer state or RNG. The caller verifies the folder and checks its layout first."""
    folder = Path(folder)
    rank, _ = _rank_world()
    tensors = load_file(str(folder / f"model-r{rank:05d}.safetensors"))
    own = _model_tensors(model)
    if tensors.keys() != own.keys():
        missing = sorted(own.keys() - tensors.keys())[:3]
        raise GenomeLMError(f"{folder}: parameters do not match the model (missing e.g. {missing})")
    with torch.no_grad():
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        for name, value in tensors.items():
            (params.get(name) if name in params else buffers[name]).copy_(value)
