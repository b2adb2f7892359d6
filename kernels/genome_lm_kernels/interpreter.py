"""Triton's interpreter (``TRITON_INTERPRET=1``, how the Triton kernels run on a CPU), made to
skip repeated work.

When a kernel launches, the interpreter patches triton.language into its interpreted builtins (and
restores them after). It patches again at every call of a ``@triton.jit`` device function from
inside the kernel, Triton's own standard-library ones included (``tl.sum``, ``tl.sigmoid``, ...):
``inspect.getmembers`` over the language modules, about 1.2 ms a call, of which the kernels make
thousands a step. Inside a launch whose patches already cover the device function's language
modules the repeat changes nothing, and ``share_language_patches`` skips it. Measured on 3
interpreted bf16 training steps of the tiny model (``tests/model/test_bf16_model.py``'s), against
the previous checkout, which skipped the repeat for KDA's own helpers only: 49.5 -> 32.2 s, the
losses bit for bit the same. What a kernel computes is untouched; on a GPU, and in the
compile check, nothing here runs.
"""

from __future__ import annotations

import inspect
import os

_DONE = False


def share_language_patches() -> bool:
    """Install the skip (once per process) when Triton's interpreter is on. Returns whether it is
    installed; False, leaving Triton alone, when the interpreter is off or is not laid out as this
    expects (Triton 3.x: ``GridExecutor``, ``InterpretedFunction``, ``_patch_lang``)."""
    global _DONE
    if _DONE:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # no triton here, or it cannot import
        return False
    if not all(hasattr(ti, n) for n in ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang",
                                        "tl")):
        return False

    patched: list[set[int]] = []  # the language modules patched so far by each launch in progress
    patch_lang, launch_call, device_call = ti._patch_lang, ti.GridExecutor.__call__, ti.InterpretedFunction.__call__

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (ti.tl, ti.tl.core)}

    def recording_patch_lang(fn):
        scope = patch_lang(fn)
        if patched:
            patched[-1].update(languages(fn))
        return scope

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_function(self, *args, **kwargs):
        if not patched or not languages(self.fn) <= patched[-1]:
            return device_call(self, *args, **kwargs)
        try:  # what device_call does after patching: run the interpreter's (cached) rewrite
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti._patch_lang, ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = (
        recording_patch_lang, launch, device_function)
    _DONE = True
    return True
