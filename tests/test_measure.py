"""genome_lm.measure, the one measurement harness: a fresh worker's result comes back, its failure
is one line naming the module and the worker's last error line, a timeout is a TimeoutError, and
the peak of a block is the memory it allocated (against an allocation of known size)."""

import sys
import textwrap

import pytest

from genome_lm import measure


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A worker module ``toy_worker`` on the path of the fresh processes (PYTHONPATH)."""
    (tmp_path / "toy_worker.py").write_text(textwrap.dedent('''
        import os, sys, time
        from genome_lm.measure import Peak, serve

        def measure(spec):
            if spec.get("fail"):
                raise ValueError("the toy worker was told to fail")
            if spec.get("sleep"):
                time.sleep(spec["sleep"])
            with Peak() as peak:
                block = bytearray(spec["bytes"])
                block[::4096] = b"x" * len(block[::4096])  # touch every page
            return {"bytes": peak.bytes, "seconds": peak.seconds, "omp": os.environ.get("OMP_NUM_THREADS"),
                    "dynamo": os.environ.get("TORCHDYNAMO_DISABLE"),
                    "extra": os.environ.get("TOY_EXTRA"), "rank": spec.get("rank")}

        if __name__ == "__main__":
            serve(measure)
    '''))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    return "toy_worker"


def test_a_fresh_worker_measures_what_it_allocates(worker):
    result = measure.run_fresh(worker, {"bytes": 64 * 2**20}, timeout=60, threads=1, env={"TOY_EXTRA": "yes"})
    assert 64 * 2**20 <= result["bytes"] < 72 * 2**20  # the block, and little else
    assert result["omp"] == "1" and result["dynamo"] == "1" and result["extra"] == "yes"


def test_ranks_run_together_and_come_back_in_order(worker):
    results = measure.run_fresh_ranks(worker, [{"bytes": 2**20, "rank": r} for r in range(3)], timeout=60)
    assert [r["rank"] for r in results] == [0, 1, 2]


def test_a_failing_worker_is_one_line_and_a_slow_one_times_out(worker):
    with pytest.raises(measure.MeasurementError, match="toy_worker failed: ValueError: the toy worker was told"):
        measure.run_fresh(worker, {"fail": True, "bytes": 0}, timeout=60)
    with pytest.raises(TimeoutError, match="toy_worker took more than 1 s"):
        measure.run_fresh(worker, {"sleep": 30, "bytes": 0}, timeout=1)
    with pytest.raises(measure.MeasurementError, match="failed"):
        measure.run_fresh_ranks(worker, [{"bytes": 0}, {"fail": True, "bytes": 0}], timeout=60)


def test_the_sampled_peak_sees_a_block_freed_inside_it():
    """A fresh mapping (not memory the allocator already holds resident), every page written,
    then unmapped before the block ends: the sampler saw it."""
    import mmap
    import time

    size = 48 * 2**20
    with measure.SampledPeak() as peak:
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        time.sleep(0.05)  # several samples while it is resident
        block.close()
    assert peak.delta >= 40 * 2**20
