"""keep_freed_memory: a large tensor freed and allocated again reuses the heap instead of a
fresh mapping whose every page faults in again (measured in a fresh process, before and after,
once the heap has grown to the loop's peak)."""

import os
import subprocess
import sys

import pytest

FAULTS = """
import resource, sys, torch

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(16 << 20)  # 64 MiB, written and freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""

CODE = FAULTS + """
from genome_lm.engine.allocator import keep_freed_memory

default = faults()
assert keep_freed_memory() and keep_freed_memory()  # idempotent
for _ in range(3):  # the heap grows to the loop's peak, faulting its pages in once
    faults()
print(default, faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux only")
def test_freed_tensors_are_reused_without_page_faults():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    default, kept = (int(x) for x in done.stdout.split())
    assert default > 5 * 16_000  # glibc maps each 64 MiB block afresh: 16,384 pages each time
    assert kept < default // 20, (default, kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux only")
@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_a_process_that_tunes_malloc_itself_keeps_its_settings(env):
    """A memory measurement that sets glibc's thresholds (tests/model/test_prefill.py's) is left
    alone: keep_freed_memory declines, and freed blocks still go back to the kernel."""
    code = CODE.replace("assert keep_freed_memory() and keep_freed_memory()", "assert not keep_freed_memory()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    default, kept = (int(x) for x in done.stdout.split())
    assert kept > default // 2, (default, kept)


FIT = FAULTS + """
from genome_lm.engine.allocator import heap_fits, use_heap

GiB = 2**30
policy = use_heap("keep" if heap_fits(float(sys.argv[1]) * GiB, ranks_here=2, memory=24 * GiB) else "return")
assert use_heap(policy) == policy  # idempotent
for _ in range(3):
    faults()
print(policy, faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux only")
@pytest.mark.parametrize("peak,policy", [(1, "keep"), (7, "return")])
def test_the_heap_is_kept_only_where_twice_the_plan_fits(peak, policy):
    """In a fresh process: the heap keeps freed blocks (no page faults once the heap has grown)
    for a small planned peak, and returns them (every 64 MiB block faults in again) when twice
    the plan would not fit the rank's share (2 ranks on 24 GiB: 2 x 7 GiB > 12 GiB)."""
    done = subprocess.run([sys.executable, "-c", FIT, str(peak)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got, faults = done.stdout.split()
    assert got == policy
    if policy == "keep":
        assert int(faults) < 4000, done.stdout
    else:
        assert int(faults) > 5 * 16_000, done.stdout


EVAL = """
import sys
from genome_lm.engine.parallel import ParallelSizes
from genome_lm.engine.allocator import use_heap
from genome_lm.eval.evaluate import eval_heap
print(use_heap(eval_heap(ParallelSizes(cp=int(sys.argv[1])))))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux only")
@pytest.mark.parametrize("cp,policy", [(1, "keep"), (2, "return")])
def test_a_split_eval_returns_freed_memory(cp, policy):
    """A split model scores whole windows (memory growing with the window): its heap returns
    freed blocks; one rank's chunked prefill keeps them (each in a fresh process)."""
    done = subprocess.run([sys.executable, "-c", EVAL, str(cp)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == policy
