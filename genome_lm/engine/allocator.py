"""Host memory for CPU runs: large tensors reuse the heap instead of fresh mappings every step.

glibc serves an allocation above its mmap threshold (128 KiB, rising with use to at most 32 MiB)
with a fresh ``mmap`` and returns it to the kernel when it is freed. A CPU step allocates and
frees the same large temporaries again and again (DSA's gathered blocks and dense scores, the
indexer's pool scores, mHC's streams: 8-64 MiB each), so each one faults its pages in again and
the kernel zeroes every 4 KiB page of it: thousands of page faults per step, the step's time
swinging by half from run to run. :func:`keep_freed_memory` raises the mmap threshold to 1 GiB
and the trim threshold to 2 GiB (``mallopt``): freed blocks stay in the process's heap and the
next step's tensors reuse them.

The cost is resident memory: what a step freed stays mapped (up to the peak it reached, as with
a caching allocator). Linux with glibc only (``mallopt``); elsewhere nothing changes. GPU runs
do not call it: their tensors live on the device. A process whose environment already tunes
glibc's malloc (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``glibc.malloc`` in
``GLIBC_TUNABLES``) keeps its own settings: a memory measurement may want freed memory returned.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below this come from the heap
TRIM_THRESHOLD = 2 << 30  # free memory at the heap's top kept up to this

_state = {"done": False}


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process (idempotent); returns whether they
    are set (False where there is no glibc ``mallopt``, it refused, or the environment sets
    malloc's own)."""
    if _state["done"]:
        return True
    if not sys.platform.startswith("linux") or user_tuned():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _state["done"] = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _state["done"]


def user_tuned() -> bool:
    """Whether this process's environment sets glibc malloc's thresholds itself."""
    return (any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))
