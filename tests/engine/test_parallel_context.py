"""``parallel_context`` leaves no process groups behind.

megatron-core's ``destroy_model_parallel`` forgets its groups without destroying them, and each
gloo group keeps threads that wake up a few hundred times a second. A process that built a few
hundred models (the test suite did) ended up with over a thousand such threads, using more
than a core between them. Each check runs in a fresh process, so nothing else's groups count.
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, warnings
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from genome_lm.engine.parallel import ParallelSizes, init_distributed, parallel_context

    def threads():
        return len(os.listdir("/proc/self/task"))

    def build_twice():
        for _ in range(2):
            with parallel_context(ParallelSizes()) as pg:
                assert pg.tp.size() == 1
    {setup}
    build_twice()  # warm up whatever the first use starts for good (torch's own threads)
    start = threads()
    for _ in range(3):
        build_twice()
    print("threads", start, threads())
    print("initialised", dist.is_initialized())
    """
)


def _run(setup: str) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}


@pytest.mark.slow
def test_a_context_that_started_the_default_group_destroys_everything():
    seen = _run("")
    start, end = map(int, seen["threads"])
    assert end <= start, f"{end - start} threads left behind by 6 contexts"
    assert seen["initialised"] == ["False"]


@pytest.mark.slow
def test_under_an_existing_default_group_only_the_new_groups_go():
    seen = _run("init_distributed()")
    start, end = map(int, seen["threads"])
    assert end <= start, f"{end - start} threads left behind by 6 contexts"
    assert seen["initialised"] == ["True"]  # the caller's group stays
