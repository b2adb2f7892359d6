"""Call genome-lm's C kernels for the CPU path.

Each op folder's torch path is a chain of tensor ops; on a CPU its time goes to the temporaries
between them, not to arithmetic (issue 28's profile: 3.7 GFLOP/s where the core does 23-36).
The C files here do the same arithmetic in one pass per query, vectorised by the compiler;
threads come from Python (cffi releases the GIL during a call).

They are built at install (``build.py``, through ``setup.py``'s ``cffi_modules``) into one
extension module per instruction-set level; ``library()`` imports the highest this CPU runs. The
declarations both sides use are ``kernels.h``. Nothing is compiled at run time. Whether an op runs
in C is decided once, by ``genome_lm_kernels.resolve_backend`` (``KernelBackend.native``), from
``available()``; the ops read it from the backend they are given.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

MIN_ROWS_PER_THREAD = 32  # fewer rows than this per thread: one thread (a call costs ~20 us)
LEVELS = {4: "v4", 3: "v3"}  # genome_lm_cpu_level() -> the module built for it (the rest: "base")
NOT_BUILT = ("genome-lm's C kernels are not built in this install (genome_lm_kernels.cpu._native_base is missing): "
             "reinstall with `pip install -e .` (it compiles them; a C compiler is needed at install)")


@functools.cache
def _module():
    """The extension module for this CPU's level, or None when none is built."""
    try:
        base = importlib.import_module("genome_lm_kernels.cpu._native_base")
    except ImportError:
        return None
    from .build import source_hash

    built, here = base.ffi.string(base.lib.genome_lm_source_hash()).decode(), source_hash()
    if built != here:
        warnings.warn(f"genome-lm's C kernels were built from other sources ({built}, these are {here}): the torch "
                      "path runs instead; reinstall with `pip install -e .` to rebuild them", RuntimeWarning,
                      stacklevel=3)
        return None
    level = LEVELS.get(base.lib.genome_lm_cpu_level())
    if level:
        try:
            return importlib.import_module(f"genome_lm_kernels.cpu._native_{level}")
        except ImportError:  # an install built on a CPU without that level: the baseline runs
            pass
    return base


def available() -> bool:
    """The C kernels are built in this install (an import; nothing is compiled)."""
    return _module() is not None


def level() -> str:
    """The instruction-set level of the module in use ("v4", "v3" or "base"); "" when none."""
    module = _module()
    return module.__name__.rsplit("_", 1)[-1] if module else ""


def _built():
    module = _module()
    if module is None:
        raise RuntimeError(NOT_BUILT)
    return module


def library(name: str | None = None):
    """The built kernels (cffi's ``lib``: ``dsa_*``, ``kda_*``, ``mhc_*``); RuntimeError when
    they are not built. ``name``: the op family the caller uses (all are in one module)."""
    return _built().lib


def ffi():
    """cffi's ``ffi`` of the built module (pointer casts); RuntimeError when not built."""
    return _built().ffi


def usable(*tensors: torch.Tensor) -> bool:
    """Tensors the C kernels take: on the CPU and not fp64 (fp64 stays on the torch path, the
    precision reference)."""
    return all(t.device.type == "cpu" and t.dtype != torch.float64 for t in tensors)


def f32(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous fp32, the layout every C kernel reads (no copy when it already is)."""
    return x.to(torch.float32).contiguous()


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="genome-lm-native")


def split_rows(rows: int, min_per_thread: int | None = None) -> list[tuple[int, int]]:
    """[r0, r1) ranges, one per thread (torch's intra-op thread count, fewer for few rows: at
    least ``min_per_thread`` each, default ``MIN_ROWS_PER_THREAD``)."""
    n = max(1, min(torch.get_num_threads(), rows // (min_per_thread or MIN_ROWS_PER_THREAD)))
    bounds = [rows * i // n for i in range(n + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def run_rows(fn, ranges, args_for):
    """Call ``fn(*args_for(i, r0, r1))`` for each range, on threads when there are several.
    MemoryError when a call could not allocate its work buffer (its return code)."""
    if len(ranges) == 1:
        codes = [fn(*args_for(0, *ranges[0]))]
    else:
        futures = [_pool(len(ranges)).submit(fn, *args_for(i, a, b)) for i, (a, b) in enumerate(ranges)]
        codes = [f.result() for f in futures]
    if any(codes):
        raise MemoryError(f"genome-lm's C kernel {fn.__name__} could not allocate its work buffer")


def ptr(t: torch.Tensor | None):
    """A tensor's data as the pointer the C kernels take (its dtype is the caller's to check);
    None: NULL (an optional output or input)."""
    return ffi().NULL if t is None else ffi().cast("void *", t.data_ptr())
