"""megatron-core on a machine without a GPU: every redirection it needs, in one place.

megatron-core 0.19.2 allocates some buffers on ``torch.cuda.current_device()`` (the MoE layer,
the global memory buffer, about 40 call sites), and its data-parallel gradient buffers ask for
``torch.cuda.current_stream()`` before every gradient reduction. On CPU both calls raise ("Found
no NVIDIA driver"). :func:`enable_cpu_megatron` points the first at the CPU and makes the second
a stream with nothing to wait for, for the whole process. It is called
by genome-lm's engine just before it builds megatron-core modules, only when CUDA is not
available, and never at import time; ``tests/engine/test_cpu.py`` fails when a newer
megatron-core stops needing a redirection or stops accepting it.

Pinned version: megatron-core 0.19.x. Its releases from 0.17 need Python 3.12, and context
parallel for DSA and for gated delta net (the pattern genome-lm's KDA layer follows) arrived
after 0.16.

Not redirected (use instead): the all-to-all token dispatcher creates CUDA streams in its
constructor, so on CPU use ``moe_token_dispatcher_type="allgather"``; Transformer Engine does
not install without CUDA, so CPU runs use megatron-core's local (torch) layer specs.
"""

from __future__ import annotations

import torch

from .backend import on_gpu

_state = {"enabled": False, "current_device": None, "current_stream": None}


class _NullStream:
    """What megatron-core's gradient buffers get for ``torch.cuda.current_stream()`` on CPU: CPU
    work is synchronous, so waiting on a stream or event has nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def enable_cpu_megatron() -> bool:
    """Redirect megatron-core's CUDA-only calls to the CPU; returns whether it did anything.

    Idempotent. Does nothing when a GPU is present.
    """
    if on_gpu() or _state["enabled"]:
        return False
    _state["current_device"] = torch.cuda.current_device
    _state["current_stream"] = torch.cuda.current_stream
    torch.cuda.current_device = _cpu_device
    torch.cuda.current_stream = _null_stream
    _state["enabled"] = True
    return True


def disable_cpu_megatron() -> None:
    """Undo :func:`enable_cpu_megatron` (tests use it)."""
    if _state["enabled"]:
        torch.cuda.current_device = _state["current_device"]
        torch.cuda.current_stream = _state["current_stream"]
        _state["enabled"] = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _null_stream(device=None) -> _NullStream:
    return _NullStream()
