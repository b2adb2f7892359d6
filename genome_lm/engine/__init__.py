"""Where genome-lm meets megatron-core's process-wide machinery."""

from __future__ import annotations

import contextlib
import logging
import warnings


@contextlib.contextmanager
def quiet_megatron_import():
    """Import megatron-core without its CPU-only warnings (no Transformer Engine, no CUDA).

    Those warnings are expected on a CPU machine and say nothing a user can act on.
    """
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
