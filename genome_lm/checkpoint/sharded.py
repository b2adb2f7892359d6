"""Layout-free tensors for training checkpoints: each tensor stored once, as the pieces the ranks
hold, each placed in the whole tensor, so that any parallel layout and world size can read it.

A tensor of a checkpoint (a parameter, a router's expert bias, an Adam moment) has a **key**, its
name in the whole model (``model/layers.7.mlp.experts.local_experts.130.linear_fc1.weight``: layers
numbered as in the whole model, experts by their global index), and a **global shape**. A rank
holds one **box** of it (an offset and a size per dimension):

- tensor parallel cuts ``param.partition_dim`` into equal contiguous parts (the rule of
  ``engine.layout.tp_slice``); a GLU ``linear_fc1`` (``[gate; up]``, split as ``[gate_r; up_r]``)
  is seen as ``[2, F, H]``, in which a rank's part is the box at ``(0, r * F / tp, 0)``;
- expert parallel: a rank's local expert ``j`` is global expert ``ep_rank * local + j``;
- pipeline parallel: a stage's layer ``i`` is the model's ``layer_offset + i``;
- everything else (norms, mHC, routers; every tensor of a plain ``nn.Module``) is whole.

**Saving** (collective): the ranks agree on one writer per distinct box, the lowest rank that holds
it (data- and context-parallel replicas, and tensor-parallel ranks of an unsplit tensor, hold the
same box), and each writes its boxes into its own safetensors files as ``<key>@<offset>``. The
index of every piece (file, name, offset, size) is gathered into ``meta.json``.

**Loading**: each rank asks for the box of each of its tensors under its own layout and reads the
pieces that meet it through memory-mapped slices (``safe_open(...).get_slice``): only those bytes,
never the whole model. A box that the pieces do not cover, a key the checkpoint lacks or a global
shape that differs is a one-line error naming the checkpoint.

Why not megatron-core's ``dist_checkpointing`` or torch's DCP, which do the same placement: both
read their ``.metadata`` with ``pickle.load``, and genome-lm's checkpoints promise that loading
one unpickles nothing beyond tensors and numbers. safetensors files and a JSON index keep that
promise, and the placement rules are the ones the Hugging Face loader already uses.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from genome_lm.engine.layout import global_expert_name
from genome_lm.errors import GenomeLMError

from .huggingface import groups_of, is_glu

FORMAT = 2  # meta.json "format": 1 (or absent) is the per-rank format of earlier genome-lm versions
MODEL, OPTIM = "model/", "optim/"


@dataclass(frozen=True)
class Box:
    """Where a rank's tensor sits in the whole: ``key``, the global ``shape``, this rank's
    ``offset`` and ``size`` (the local tensor viewed as ``size``)."""

    key: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]


def _layout_of(model):
    """A function: parameter name -> (its tensor-parallel group, its expert-parallel group or
    None); None for a model without process groups (a plain module: every tensor whole)."""
    if getattr(model, "pg", None) is None:
        return None
    return lambda name: groups_of(model, name)


def box_of(model, name: str, tensor: torch.Tensor, *, groups=None) -> Box:
    """The box of ``model``'s tensor ``name`` on this rank (see the module docstring)."""
    size = tuple(tensor.shape)
    key = getattr(model, "global_name", lambda n: n)(name)
    glu = is_glu(name) and len(size) >= 1
    if glu:
        size = (2, size[0] // 2, *size[1:])
    shape, offset = list(size), [0] * len(size)
    if groups is not None:
        tp_group, ep_group = groups(name)
        if ep_group is not None:
            key = global_expert_name(key, model.cfg.n_routed_experts, ep_group)
        if getattr(tensor, "tensor_model_parallel", False) and tp_group is not None and tp_group.size() > 1:
            dim = tensor.partition_dim
            if glu:
                if dim != 0:
                    raise ValueError(f"{name}: a GLU weight split along dimension {dim}, not 0")
                dim = 1
            shape[dim] = size[dim] * tp_group.size()
            offset[dim] = size[dim] * tp_group.rank()
    return Box(MODEL + key, tuple(shape), tuple(offset), size)


def model_tensors(model, *, base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, tensor) of everything a checkpoint keeps of a model on this rank: its
    parameters and the MoE routers' expert biases (a buffer that training updates). Of a model
    with LoRA adapters (``model.peft``), only what training changes: the adapters, the tensors
    ``peft.train`` names and the expert biases of trained routers; the frozen base is named by
    its digest instead (``content_digest``). ``base``: the frozen base's tensors instead."""
    adapted = getattr(model, "peft", None) is not None
    for name, param in model.named_parameters():
        if not adapted or param.requires_grad != base:
            yield name, param
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            owner = model.get_submodule(name.rpartition(".")[0])
            if not adapted or bool(getattr(owner, "frozen_expert_bias", False)) == base:
                yield name, buf


# constants of the base's fingerprint (below 2**29, so no product leaves int64)
_MIX_BITS, _MIX_INDEX = 40_503, 2_654_435


def _fingerprint(tensor: torch.Tensor, box: Box) -> int:
    """A sum over the box's values of a mix of each value's bits and its index in the whole
    tensor: boxes of the same tensor add up to the same number under any layout (integer sums,
    exact in any order), and a changed value changes it."""
    x = tensor.detach().reshape(box.size or (1,))
    size = x.element_size()
    bits = x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).to(torch.int64)
    bits = bits & (2**(8 * size) - 1 if size < 8 else 2**62 - 1)
    shape = box.shape or (1,)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    offset = box.offset or (0,)
    rows = max(1, 2**22 // max(1, math.prod(x.shape[1:])))
    total = 0
    for start in range(0, x.shape[0], rows):
        part = bits[start:start + rows]
        index = torch.zeros((), dtype=torch.int64, device=x.device)
        for d, n in enumerate(part.shape):
            first = offset[d] + (start if d == 0 else 0)
            view = [1] * part.dim()
            view[d] = n
            index = index + (torch.arange(n, device=x.device) + first).view(view) * strides[d]
        total += int((((part * _MIX_BITS) ^ (index * _MIX_INDEX)) & 0x7FFFFFFF).sum())
    return total


def content_digest(model) -> str:
    """Collective. A SHA-256 over ``model``'s frozen base (``model_tensors(base=True)``, or every
    tensor of a model without adapters): each tensor's key, global shape, dtype and fingerprint
    (boxes held by several ranks counted once), so the same weights give the same digest under
    any parallel layout, and any changed value, shape or dtype another."""
    groups = _layout_of(model)
    adapted = getattr(model, "peft", None) is not None
    mine = {}
    for name, t in model_tensors(model, base=adapted):
        box = box_of(model, name, t, groups=groups)
        mine[(box.key, box.offset)] = (box.shape, str(t.dtype), _fingerprint(t, box))
    sums: dict[str, list] = {}
    seen = set()
    for part in _gather_objects(mine):
        for (key, offset), (shape, dtype, value) in part.items():
            if (key, offset) in seen:
                continue
            seen.add((key, offset))
            entry = sums.setdefault(key, [shape, dtype, 0])
            entry[2] += value
    lines = "".join(f"{key} {list(shape)} {dtype} {value}\n" for key, (shape, dtype, value) in sorted(sums.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def model_boxes(model) -> dict[str, tuple[torch.Tensor, Box]]:
    """Local name -> (tensor, box) for ``model_tensors``."""
    groups = _layout_of(model)
    return {name: (t, box_of(model, name, t, groups=groups)) for name, t in model_tensors(model)}


def optimizer_boxes(model, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, Box]]:
    """(tensor, box) of a per-parameter optimizer's state (torch's Adam/AdamW): a moment has its
    parameter's box under ``optim/<state name>/``; a scalar (Adam's ``step``) is whole."""
    boxes = {id(t): box for t, box in model_boxes(model).values()}
    out = []
    for param, state in optimizer.state.items():
        if id(param) not in boxes:
            raise ValueError("the optimizer holds a parameter the model does not")
        box = boxes[id(param)]
        name = box.key[len(MODEL):]
        for what, value in sorted(state.items()):
            if not torch.is_tensor(value):
                raise GenomeLMError(f"optimizer state {what!r} of {name} is not a tensor ({type(value).__name__})")
            key = f"{OPTIM}{what}/{name}"
            if value.dim() == 0:
                out.append((value, Box(key, (), (), ())))
            elif value.numel() == param.numel():
                out.append((value, Box(key, box.shape, box.offset, box.size)))
            else:
                raise GenomeLMError(f"optimizer state {what!r} of {name} has shape {tuple(value.shape)}, neither "
                                    f"a scalar nor the parameter's {tuple(param.shape)}")
    return out


def _gather_objects(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_pieces(folder: Path, rank: int, entries: list[tuple[torch.Tensor, Box]]) -> dict:
    """Collective. Write this rank's share of ``entries``: each distinct box once, by the lowest
    rank that holds it. Returns the index of every rank's pieces (on every rank):
    ``{key: {"shape", "dtype", "pieces": [{"file", "name", "offset", "size"}]}}``."""
    from safetensors.torch import save_file

    held = [(box.key, box.offset) for _, box in entries]
    everyone = _gather_objects(held)
    writer: dict[tuple, int] = {}
    for r, boxes in enumerate(everyone):
        for key, offset in boxes:
            writer.setdefault((key, tuple(offset)), r)
    files: dict[str, dict[str, torch.Tensor]] = {}
    mine = []
    for tensor, box in entries:
        if writer[(box.key, box.offset)] != rank:
            continue
        file = f"{box.key.split('/', 1)[0]}-r{rank:05d}.safetensors"
        name = f"{box.key}@{','.join(map(str, box.offset))}"
        files.setdefault(file, {})[name] = tensor.detach().reshape(box.size).contiguous()
        mine.append({"key": box.key, "shape": list(box.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                     "file": file, "name": name, "offset": list(box.offset), "size": list(box.size)})
    for file, tensors in files.items():
        save_file(tensors, str(folder / file), metadata={"format": "genome-lm pieces"})
    index: dict[str, dict] = {}
    for pieces in _gather_objects(mine):
        for p in pieces:
            entry = index.setdefault(p["key"], {"shape": p["shape"], "dtype": p["dtype"], "pieces": []})
            entry["pieces"].append({k: p[k] for k in ("file", "name", "offset", "size")})
    return dict(sorted(index.items()))


class PieceReader:
    """Reads boxes of a checkpoint's tensors from its pieces (``meta["tensors"]``), one
    memory-mapped file at a time as needed; ``close`` unmaps them."""

    def __init__(self, folder: str | Path, index: dict):
        self.folder, self.index = Path(folder), index
        self._handles: dict[str, object] = {}

    def keys(self, prefix: str = MODEL) -> list[str]:
        return [k for k in self.index if k.startswith(prefix)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def _entry(self, key: str) -> dict:
        if key not in self.index:
            raise GenomeLMError(f"{self.folder}: holds no tensor {key.split('/', 1)[1]} (a checkpoint of another "
                                "model or configuration?)")
        return self.index[key]

    def _file(self, file: str):
        if file not in self._handles:
            path = self.folder / file
            if not path.exists():
                raise GenomeLMError(f"{path}: missing (a piece of the checkpoint)")
            self._handles[file] = safe_open(path, "pt")
        return self._handles[file]

    def read(self, box: Box) -> torch.Tensor:
        """The tensor in ``box`` (``box.size``, in the stored dtype), assembled from the pieces."""
        entry = self._entry(box.key)
        name = box.key.split("/", 1)[1]
        if tuple(entry["shape"]) != box.shape:
            raise GenomeLMError(f"{self.folder}: {name} has shape {tuple(entry['shape'])} in the checkpoint, the "
                                f"model's is {box.shape} (a checkpoint of another model or configuration?)")
        out = torch.empty(box.size, dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for piece in entry["pieces"]:
            lo = [max(a, b) for a, b in zip(piece["offset"], box.offset)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(piece["offset"], piece["size"], box.offset, box.size)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            handle = self._file(piece["file"])
            if not box.size:  # a scalar
                out.copy_(handle.get_tensor(piece["name"]))
                covered = 1
                break
            src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, piece["offset"]))
            dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, box.offset))
            if piece.get("reshape"):  # stored in another shape (an earlier format's GLU weight)
                out[dst] = handle.get_tensor(piece["name"]).reshape(piece["size"])[src]
            else:
                out[dst] = handle.get_slice(piece["name"])[src]
            covered += math.prod(h - low for low, h in zip(lo, hi))
        if covered != math.prod(box.size):
            raise GenomeLMError(f"{self.folder}: the pieces of {name} cover {covered} of the {math.prod(box.size)} "
                                f"values this rank needs (offset {box.offset}, size {box.size}): a piece is missing")
        return out

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (a GLU weight as stored, ``[2, F, H]``)."""
        shape = self.shape(key)
        return self.read(Box(key, shape, (0,) * len(shape), shape))

    def close(self) -> None:
        self._handles.clear()


def full_model_tensors(reader: PieceReader, *, unmap_every: int = 64 * 2**20,
                       keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every weight (those whose key ``keep`` accepts), one at a time, in
    the index's order; a GLU weight in its parameter's shape ``[2 F, H]``. The files are unmapped
    after every ``unmap_every`` bytes read: mapped pages that were read count in the process's
    resident memory until then."""
    read = 0
    for key in reader.keys(MODEL):
        if keep is not None and not keep(key):
            continue
        tensor = reader.full(key)
        name = key[len(MODEL):]
        read += tensor.numel() * tensor.element_size()
        if read >= unmap_every:
            reader.close()
            read = 0
        yield name, tensor.reshape(-1, *tensor.shape[2:]) if is_glu(name) else tensor


@torch.no_grad()
def load_model_pieces(reader: PieceReader, model) -> None:
    """Copy the checkpoint's weights into ``model`` under its own layout. The model's tensors must
    be exactly the checkpoint's (checked over all ranks: a key neither side lacks)."""
    boxes = model_boxes(model)
    wanted = set()
    for keys in _gather_objects(sorted(box.key for _, box in boxes.values())):
        wanted.update(keys)
    stored = set(reader.keys(MODEL))
    if wanted != stored:
        extra, missing = sorted(stored - wanted), sorted(wanted - stored)
        what = (f"the model has no {extra[0][len(MODEL):]}" if extra else
                f"it holds no {missing[0][len(MODEL):]}")
        raise GenomeLMError(f"{reader.folder}: its weights are not this model's ({what}; "
                            f"{len(missing)} missing, {len(extra)} extra): a checkpoint of another model or "
                            "configuration?")
    for name, (tensor, box) in boxes.items():
        tensor.copy_(reader.read(box).reshape(tensor.shape))


def load_optimizer_pieces(reader: PieceReader, model, optimizer: torch.optim.Optimizer) -> None:
    """Restore a per-parameter optimizer's state (the keys ``optim/<state>/<name>``) for every
    parameter the optimizer steps."""
    boxes = {id(t): box for t, box in model_boxes(model).values()}
    kinds = sorted({k[len(OPTIM):].split("/", 1)[0] for k in reader.keys(OPTIM)})
    for group in optimizer.param_groups:
        for param in group["params"]:
            box = boxes[id(param)]
            name = box.key[len(MODEL):]
            state = {}
            for what in kinds:
                key = f"{OPTIM}{what}/{name}"
                if key not in reader.index:
                    continue
                if not reader.index[key]["shape"]:
                    state[what] = reader.read(Box(key, (), (), ()))
                else:
                    moment = reader.read(Box(key, box.shape, box.offset, box.size))
                    state[what] = moment.reshape(param.shape).to(param.device)
            if state:
                optimizer.state[param] = state


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The numbers of each parameter group (learning rate, betas, weight decay, ...): JSON."""
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups]


CONFIG_GROUP_KEYS = ("lr_scale",)  # set by this run's config (train.lr_scale), never by the checkpoint


def set_optimizer_groups(optimizer: torch.optim.Optimizer, groups: list[dict], where: Path) -> None:
    """The saved groups' numbers (betas, the step's learning rate, ...) onto ``optimizer``'s, but
    ``CONFIG_GROUP_KEYS``: a resumed run's ``train.lr_scale`` is the config's, not the one saved."""
    if len(groups) != len(optimizer.param_groups):
        raise GenomeLMError(f"{where}: the optimizer had {len(groups)} parameter groups, this one has "
                            f"{len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups):
        for k, v in saved.items():
            if k not in CONFIG_GROUP_KEYS:
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


def legacy_index(folder: Path, files: dict) -> dict:
    """The piece index of a one-rank checkpoint in the earlier format (``model-r00000.safetensors``
    with the model's own names): every tensor whole, so it loads under any layout too."""
    name = "model-r00000.safetensors"
    if name not in files:
        raise GenomeLMError(f"{folder}: no {name}")
    index = {}
    with safe_open(folder / name, "pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            shape = list(sl.get_shape())
            piece = {"file": name, "name": key}
            if is_glu(key) and shape:
                shape = [2, shape[0] // 2, *shape[1:]]
                piece["reshape"] = True
            piece.update(offset=[0] * len(shape), size=shape)
            index[MODEL + key] = {"shape": shape, "dtype": _dtype_name(sl.get_dtype()), "pieces": [piece]}
    return index


def _dtype_name(safetensors_dtype: str) -> str:
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
            "I32": "int32", "U8": "uint8", "BOOL": "bool"}[safetensors_dtype]
