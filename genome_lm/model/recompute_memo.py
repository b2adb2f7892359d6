"""Values that a recomputed forward takes from the original forward instead of computing again.

Activation recompute runs a block's forward twice (three times for a layer recomputed inside a
recomputed layer). Most of it must run again, since the point is not to keep it; but some values
are small next to their cost, and the DSA indexer's token selection is the clearest case: it is
O(T^2 / kpool) to compute and O(T * topk / kpool) to keep, and the recomputed forward would
find exactly the same selection (its inputs are the same). So a recomputed forward replays it.

The recompute wrapper (``genome_lm.train.memory.recompute``) gives each checkpointed call a
``Memo``: its forward runs under ``memo.recording()``, its recompute under ``memo.replaying()``.
``reuse(compute)`` then computes and records the value in a forward, and hands back the
recorded values, in call order, in a recompute. Checkpoints nest: a recompute may itself run
a checkpointed forward (``recompute_nested``), which records what the outer replay hands it,
so that its own recompute replays the same values. Outside any checkpoint ``reuse`` just
computes. Under ``on_host()`` (activation offload) kept tensors wait in host memory.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, TypeVar

import torch

from genome_lm.engine.backend import on_gpu

T = TypeVar("T")

_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "frames"):
        _local.frames = []
    return _local.frames


class _Frame:
    def __init__(self, memo: "Memo", replay: bool):
        self.memo, self.replay, self.position = memo, replay, 0

    def __enter__(self):
        self.position = 0  # a second backward (retain_graph) replays from the start again
        if not self.replay:
            self.memo.values.clear()
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().remove(self)
        return False


class Memo:
    """The values one checkpointed call recorded in its forward."""

    def __init__(self):
        self.values: list = []

    def recording(self) -> _Frame:
        return _Frame(self, replay=False)

    def replaying(self) -> _Frame:
        return _Frame(self, replay=True)

    def contexts(self):
        """(forward context, recompute context): the pair ``torch.utils.checkpoint``'s
        ``context_fn`` returns."""
        return self.recording(), self.replaying()


@contextlib.contextmanager
def on_host(enabled: bool = True, pinned: bool = False):
    """Keep the tensors recorded meanwhile in host memory (pinned when asked and possible), and
    bring them back to their device when replayed."""
    before = getattr(_local, "host", None)
    _local.host = (pinned and on_gpu()) if enabled else None
    try:
        yield
    finally:
        _local.host = before


class _OnHost:
    def __init__(self, value: torch.Tensor, pinned: bool):
        self.device = value.device
        self.value = value.to("cpu", non_blocking=pinned)
        if pinned:
            self.value = self.value.pin_memory() if not self.value.is_pinned() else self.value

    def back(self) -> torch.Tensor:
        return self.value.to(self.device, non_blocking=True)


def _keep(value):
    pinned = getattr(_local, "host", None)
    if pinned is None or not torch.is_tensor(value) or value.device.type == "cpu":
        return value
    return _OnHost(value, pinned)


def _restore(kept):
    return kept.back() if isinstance(kept, _OnHost) else kept


def reuse(compute: Callable[[], T], pack: Callable[[T], object] = lambda v: v,
          unpack: Callable[[object], T] = lambda v: v) -> T:
    """``compute()``, or in a recompute the value the original forward recorded at this point.

    ``pack`` turns a value into what is kept (e.g. a smaller dtype), ``unpack`` back."""
    frames = _stack()
    replay = next((i for i in range(len(frames) - 1, -1, -1) if frames[i].replay), None)
    if replay is None:
        value, kept = compute(), None
    else:
        frame = frames[replay]
        if frame.position >= len(frame.memo.values):
            raise RuntimeError("a recomputed forward asked for more values than its forward recorded: "
                               "the recompute does not follow the forward's path")
        kept = frame.memo.values[frame.position]
        frame.position += 1
        value = unpack(_restore(kept))
    # the checkpointed calls entered since (all of them, outside a recompute) record it too
    recorders = [f for f in frames[0 if replay is None else replay + 1:] if not f.replay]
    if recorders and kept is None:
        kept = _keep(pack(value))
    for frame in recorders:
        frame.memo.values.append(kept)
    return value
