"""Build, cache and call genome-lm's C kernels for the CPU path.

Each op folder's torch path is a chain of tensor ops; on a CPU its time goes to the temporaries
between them, not to arithmetic (issue 28's profile: 3.7 GFLOP/s where the core does 23-36).
The C files here do the same arithmetic in one pass per query. They are plain C (no torch or
Python headers), so a build takes about a second: ``cc -O3 -march=native -fopenmp-simd``,
vectorised by the compiler, threads from Python (ctypes releases the GIL during a call).

The shared library is cached under ``$GENOME_LM_CACHE`` (default ``$XDG_CACHE_HOME/genome-lm``,
``~/.cache/genome-lm``) in ``native/``, keyed by the source, the flags, the compiler's version and this CPU's feature flags,
and written atomically, so concurrent processes and machines sharing a home folder are safe.
Without a C compiler, or if the build fails (a warning says why, once), ``library`` returns None
and the callers run their torch path. ``GENOME_LM_NATIVE=0`` turns the C kernels off (to compare,
or to rule them out); it is the one setting genome_lm_kernels reads from the environment.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-ffp-contract=fast", "-fPIC", "-shared")
MIN_ROWS_PER_THREAD = 32  # fewer rows than this per thread: one thread (a call costs ~20 us)

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {  # library -> function -> argument types (every array is a pointer)
    "dsa": {
        "dsa_sparse_fwd": [_ptr] * 4 + [_i64] * 7 + [_f32] + [_ptr] * 2,
        "dsa_sparse_bwd": [_ptr] * 7 + [_i64] * 7 + [_f32] + [_ptr] * 3,
        "dsa_indexer_loss_dense": [_ptr] * 6 + [_i64] * 9 + [_f32] * 2 + [_ptr] * 4,
        "dsa_select_tokens": [_ptr] * 3 + [_i64] * 10 + [_f32, _ptr],
    },
    "kda": {
        "kda_fwd": [_ptr] * 5 + [_f32, _ptr] + [_i64] * 7 + [_ptr] * 3,
        "kda_bwd": [_ptr] * 5 + [_f32] + [_ptr] * 3 + [_i64] * 7 + [_ptr] * 6,
    },
    "mhc": {
        "mhc_sinkhorn_fwd": [_ptr, _i64, _i64, _i64, _f32, _i64, _i64, _ptr],
        "mhc_sinkhorn_bwd": [_ptr, _ptr, _i64, _i64, _i64, _f32, _i64, _i64, _ptr],
        "mhc_collapse_fwd": [_ptr] * 2 + [_i64] * 4 + [_ptr],
        "mhc_collapse_bwd": [_ptr] * 3 + [_i64] * 4 + [_ptr] * 2,
        "mhc_merge_fwd": [_ptr] * 4 + [_i64] * 4 + [_ptr],
        "mhc_merge_bwd": [_ptr] * 5 + [_i64] * 4 + [_ptr] * 4,
    },
}


def enabled() -> bool:
    return os.environ.get("GENOME_LM_NATIVE", "1") not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("GENOME_LM_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "genome-lm"
    return Path(root) / "native"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache
def _version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build(name: str, out_dir: Path | None = None) -> Path:
    """Compile ``name``.c into a cached shared library (if not there already) and return its
    path. Raises RuntimeError with the compiler's message when there is no compiler or it fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    source = HERE / f"{name}.c"
    version = _version(cc)
    headers = [h.read_text() for h in sorted(HERE.glob("*.h"))]  # included by every source
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *FLAGS, version, _cpu_flags()]).encode()
                         ).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{name}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        # without -march=native when the compiler refuses it (some Clang builds for arm64 do)
        errors = []
        for flags in (FLAGS, tuple(f for f in FLAGS if f != "-march=native")):
            proc = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
            if proc.returncode == 0:
                break
            errors.append((proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[0])
        else:
            raise RuntimeError(f"{cc} failed on {source.name}: {errors[0]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build(name)))
    except (RuntimeError, OSError) as exc:
        warnings.warn(f"genome-lm's C kernels ({name}.c) are not available, the torch path runs instead: {exc}",
                      RuntimeWarning, stacklevel=3)
        return None
    for fn, argtypes in SIGNATURES[name].items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = None
    return lib


def library(name: str) -> ctypes.CDLL | None:
    """The loaded library, or None when the C kernels are off or cannot be built here."""
    return _load(name) if enabled() else None


def usable(*tensors: torch.Tensor) -> bool:
    """Tensors the C kernels take: on the CPU and not fp64 (fp64 stays on the torch path, the
    precision reference)."""
    return all(t.device.type == "cpu" and t.dtype != torch.float64 for t in tensors)


def wanted(name: str, requested: bool | None, applies: bool, why: str = "the C kernels do not take these inputs"
           ) -> bool:
    """Whether an op runs in C: ``requested`` None = when it ``applies`` (the op's inputs and
    mode) and library ``name`` is built here; True = it must (RuntimeError when it cannot,
    ``why`` when it does not apply); False = the torch path."""
    if requested is None:
        return applies and library(name) is not None
    if requested and library(name) is None:
        raise RuntimeError("the C kernels are off or could not be built here (see the earlier warning)")
    if requested and not applies:
        raise RuntimeError(why)
    return requested


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
    """Call ``fn(*args_for(i, r0, r1))`` for each range, on threads when there are several."""
    if len(ranges) == 1:
        fn(*args_for(0, *ranges[0]))
        return
    futures = [_pool(len(ranges)).submit(fn, *args_for(i, a, b)) for i, (a, b) in enumerate(ranges)]
    for f in futures:
        f.result()


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()
