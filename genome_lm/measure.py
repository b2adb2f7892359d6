"""The one harness for measuring time and peak memory on this machine.

A measurement runs in a fresh process, so that the peak is that process's own high-water mark
and nothing an earlier measurement allocated (or cached) is counted:

    result = run_fresh("genome_lm.plan.measure", payload, timeout=600)   # in the caller
    serve(measure)                                                       # in the worker module's __main__

``run_fresh`` starts ``python -m MODULE JSON`` with ``worker_env`` (dynamo off, warnings off, the
thread count fixed when given, plus the caller's variables: the planner's measurements set glibc's
``MALLOC_MMAP_THRESHOLD_``) and returns the dict the worker printed as its last line; a failure
is a ``MeasurementError`` naming the worker's last error line, a timeout a ``TimeoutError``.
``run_fresh_ranks`` starts one such process per rank of a gloo group.

Inside a worker (or any process): ``Peak`` times a block and measures its peak resident growth from
Linux's high-water mark (``VmHWM``, reset when the block starts); ``SampledPeak`` samples the
resident set every 2 ms instead, for measurements in a process that is not fresh (tests).
Everything here is the standard library: it imports no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable


class MeasurementError(RuntimeError):
    """A measurement worker failed; the message is its last error line."""


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def resident_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``: cheaper to read than status)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_high_water() -> bool:
    """Reset this process's resident high-water mark to its current resident set (Linux 4.0+);
    False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Peak:
    """Seconds and peak resident growth (bytes) of a ``with`` block: ``.seconds``, ``.bytes``.
    ``barrier``: called first, before the high-water mark is reset and the clock starts (ranks of
    a group start the measured step together)."""

    def __init__(self, barrier: Callable[[], Any] | None = None):
        self.barrier = barrier
        self.seconds, self.bytes = 0.0, 0

    def __enter__(self) -> "Peak":
        if self.barrier is not None:
            self.barrier()
        reset_high_water()
        self.base = status_bytes("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.bytes = max(status_bytes("VmHWM") - self.base, 0)


class SampledPeak:
    """Peak resident growth (bytes, ``.delta``) over a ``with`` block, the resident set sampled
    every 2 ms by a thread: for a process whose high-water mark earlier work has already set."""

    def __enter__(self) -> "SampledPeak":
        self.base = self.peak = resident_bytes()
        self._stop = False
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()
        self.delta = max(self.peak, resident_bytes()) - self.base

    def _poll(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.002)


def worker_env(threads: int | None = None, extra: dict | None = None) -> dict:
    """The environment of a measurement worker."""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return {**env, **(extra or {})}


def _command(module: str, payload: dict) -> list[str]:
    return [sys.executable, "-m", module, json.dumps(payload)]


def _result(module: str, returncode: int, out: str, err: str) -> dict:
    if returncode != 0:
        lines = (err or "").strip().splitlines()
        raise MeasurementError(f"{module} failed: {lines[-1] if lines else f'exit {returncode}'}")
    lines = out.strip().splitlines()
    if not lines:
        raise MeasurementError(f"{module} printed no result")
    return json.loads(lines[-1])


def run_fresh(module: str, payload: dict, *, timeout: float, threads: int | None = None,
              env: dict | None = None) -> dict:
    """Run ``python -m module JSON(payload)`` in a fresh process and return its result."""
    try:
        proc = subprocess.run(_command(module, payload), capture_output=True, text=True, timeout=timeout,
                              env=worker_env(threads, env))
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"{module} took more than {timeout:.0f} s") from exc
    return _result(module, proc.returncode, proc.stdout, proc.stderr)


def run_fresh_ranks(module: str, payloads: list[dict], *, timeout: float, threads: int | None = None,
                    env: dict | None = None) -> list[dict]:
    """One fresh process per payload, started together (the ranks of one group); their results
    in order. Every process is killed if one fails or the time runs out."""
    procs = [subprocess.Popen(_command(module, p), env=worker_env(threads, env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for p in payloads]
    try:
        results = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError(f"{module} took more than {timeout:.0f} s") from exc
            results.append(_result(module, proc.returncode, out, err))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def serve(measure: Callable[[dict], dict]) -> None:
    """A worker module's ``__main__``: call ``measure`` on the JSON payload of the command line and
    print its result as the last line of output."""
    result = measure(json.loads(sys.argv[-1]))
    print(json.dumps(result), flush=True)
