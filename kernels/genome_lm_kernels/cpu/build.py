"""The C kernels as Python extension modules, built at install by cffi in API mode.

``pip install -e .`` (``setup.py``: ``cffi_modules``) compiles ``dsa.c``, ``kda.c`` and ``mhc.c``
once per instruction-set level into ``genome_lm_kernels.cpu._native_<level>``; ``native.py``
imports the highest level this CPU runs (``genome_lm_cpu_level``, asked of the baseline module). The
Python side's declarations (the cdef) are ``kernels.h``, which every source includes, so a
definition that drifts from its declaration fails to compile, and cffi compiles every call from
Python against the same declaration (no hand-written argument types). No ``-march=native``: the
levels are fixed targets, the same on the machine that builds and the one that runs.

After editing a source, rebuild with ``pip install -e .`` (``native.py`` does not use modules
built from other sources).
"""

from __future__ import annotations

import hashlib
import platform
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ("dsa.c", "kda.c", "mhc.c")  # and level.c, the CPU probe
# what the kernels' loops need to vectorise: reassociation and contraction of float sums, no errno
FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-ffp-contract=fast", "-Wall", "-Wno-unused-function", "-Wno-psabi", "-Werror=implicit-function-declaration",
         "-Werror=incompatible-pointer-types", "-Werror=int-conversion"]
X86 = platform.machine().lower() in ("x86_64", "amd64")
# level name -> -march (None: the compiler's default target, the baseline every build has)
LEVELS = {"base": None, **({"v3": "x86-64-v3", "v4": "x86-64-v4"} if X86 else {})}


def declarations(source_dir: Path = HERE) -> str:
    """``kernels.h`` without its preprocessor lines and comments: what cffi's cdef reads."""
    text = re.sub(r"/\*.*?\*/", "", (source_dir / "kernels.h").read_text(), flags=re.S)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines) + "\n#define GENOME_LM_NO_MEMORY 1\n"


def source_hash(source_dir: Path = HERE) -> str:
    """A digest of the sources, the declarations and the flags: compiled into every module, and
    compared by ``native.py`` with the sources beside it (a module built from other sources, as
    after editing a .c file without reinstalling, is not used)."""
    # the named sources and the headers only (not cffi's generated wrappers, should they land here)
    names = sorted([*SOURCES, "level.c", *(p.name for p in source_dir.glob("*.h"))])
    text = "\0".join([*(n + (source_dir / n).read_text() for n in names), *FLAGS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def builder(level: str, source_dir: Path = HERE):
    """The cffi builder (an ``FFI``) of one level's module (from the sources in ``source_dir``)."""
    ffi = FFI()
    ffi.cdef(declarations(source_dir))
    march = LEVELS[level]
    sources = [*SOURCES, "level.c"]
    # relative paths where it can (setuptools runs from the project root and refuses absolute ones)
    root = source_dir.relative_to(Path.cwd()) if source_dir.is_relative_to(Path.cwd()) else source_dir
    ffi.set_source(f"genome_lm_kernels.cpu._native_{level}", '#include "kernels.h"',
                   sources=[str(root / s) for s in sources], include_dirs=[str(root)],
                   extra_compile_args=FLAGS + ([f"-march={march}"] if march else []), libraries=["m"],
                   define_macros=[("GENOME_LM_SOURCE_HASH", f'"{source_hash(source_dir)}"')])
    return ffi


# what setup.py's cffi_modules name ("kernels/genome_lm_kernels/cpu/build.py:ffi_base", ...), made
# when cffi runs this file to build (its __name__ is then "__cffi__"), not when native.py imports it
if __name__ == "__cffi__":
    for _level in LEVELS:
        globals()[f"ffi_{_level}"] = builder(_level)
