"""The C kernels' extension modules (``kernels/genome_lm_kernels/cpu/build.py``), built at install;
everything else about the package is in pyproject.toml."""

import platform

from setuptools import setup

LEVELS = ["base"] + (["v3", "v4"] if platform.machine().lower() in ("x86_64", "amd64") else [])

setup(cffi_modules=[f"kernels/genome_lm_kernels/cpu/build.py:ffi_{level}" for level in LEVELS])
