"""Host memory for CPU runs: large tensors reuse the heap instead of fresh mappings every step.

glibc serves an allocation above its mmap threshold (128 KiB, rising with use to at most 32 MiB)
with a fresh ``mmap`` and returns it to the kernel when it is freed. A CPU step allocates and
frees the same large temporaries again and again (DSA's gathered blocks and dense scores, the
indexer's pool scores, mHC's streams: 8-64 MiB each), so each one faults its pages in again and
the kernel zeroes every 4 KiB page of it: thousands of page faults per step, the step's time
swinging by half from run to run. :func:`keep_freed_memory` raises the mmap threshold to 1 GiB
and the trim threshold to 2 GiB (``mallopt``): freed blocks stay in the process's heap and the
next step's tensors reuse them.

The cost is resident memory: what a step freed stays mapped, and a heap that serves blocks of
every size from 64 KiB to hundreds of MiB fragments. Measured on the hg38 twin's training step
(tiny-long, 128k tokens, context parallel 2, 2 cores; peak resident set of a rank, whose
libraries and model take 1.04 GiB): 4.04 GiB with the heap kept, 4.05 GiB with glibc's own
defaults, 3.56 GiB with the mmap threshold at 64 MiB, 2.68 GiB at 4 MiB and 2.59 GiB at 64 KiB;
the planner's activations for that step are 1.60 GiB. Kept heap costs up to twice the step's
live tensors. ``memory.host_heap: auto`` therefore keeps freed memory only where twice the planned
peak fits the rank's share of the machine's memory (:func:`heap_fits`), and otherwise returns every block above
:data:`RETURN_THRESHOLD` when it is freed (about 10% slower at 128k, and the resident set
follows the live tensors and the plan).

Linux with glibc only (``mallopt``); elsewhere nothing changes. GPU runs do not call it: their
tensors live on the device. A process whose environment already tunes glibc's malloc
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``glibc.malloc`` in ``GLIBC_TUNABLES``)
keeps its own settings: a memory measurement may want freed memory returned.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below this come from the heap
TRIM_THRESHOLD = 2 << 30  # free memory at the heap's top kept up to this

RETURN_THRESHOLD = 4 << 20  # "return": blocks above 4 MiB are mapped afresh and unmapped when freed
HEAP_COST = 2.0  # kept heap's resident peak over the step's live tensors, at most (measured above)

_state = {"policy": None}


def _mallopt():
    if not sys.platform.startswith("linux") or user_tuned():
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def _set(policy: str, mmap: int, trim: int) -> bool:
    if _state["policy"] == policy:
        return True
    mallopt = _mallopt()
    if mallopt is None or not (mallopt(M_MMAP_THRESHOLD, mmap) and mallopt(M_TRIM_THRESHOLD, trim)):
        return False
    _state["policy"] = policy
    return True


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds so that freed blocks stay in the heap (idempotent);
    returns whether they are set (False where there is no glibc ``mallopt``, it refused, or the
    environment sets malloc's own)."""
    return _set("keep", MMAP_THRESHOLD, TRIM_THRESHOLD)


def return_freed_memory() -> bool:
    """Set glibc's thresholds so that blocks above ``RETURN_THRESHOLD`` go back to the system
    when freed: the resident set follows the live tensors."""
    return _set("return", RETURN_THRESHOLD, 2 * RETURN_THRESHOLD)


def heap_fits(planned_peak: float, ranks_here: int, memory: int | None = None) -> bool:
    """Whether ``HEAP_COST`` times a step's ``planned_peak`` (bytes) fits a rank's share of the
    machine's ``memory`` (default: all of it) among ``ranks_here`` ranks."""
    memory = memory if memory is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HEAP_COST * planned_peak <= memory / max(ranks_here, 1)


def use_heap(policy: str) -> str | None:
    """Set this process's heap policy: "return" (``return_freed_memory``), else keep (``"keep"``,
    and an unresolved ``"auto"``). Returns the policy set, or None where malloc is left alone."""
    policy = "return" if policy == "return" else "keep"
    return policy if (return_freed_memory() if policy == "return" else keep_freed_memory()) else None


def user_tuned() -> bool:
    """Whether this process's environment sets glibc malloc's thresholds itself."""
    return (any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))
