"""memory.host_heap: auto is resolved from the plan: freed memory stays in the heap where twice
the planned peak fits a rank's share of the machine, else it goes back to the system."""

from genome_lm.config import load_config
from genome_lm.plan.memory_model import Hardware, estimate, host_heap

GiB = 2**30


def test_auto_keeps_the_heap_only_where_twice_the_plan_fits():
    # 512k, context parallel 2: 5.9 GiB a rank planned (the shipped twin sets "return" itself)
    twin = load_config("hg38-twin-cpu", ["memory.host_heap=auto"])
    peak = estimate(twin, Hardware(device="cpu", gpus=2)).peak
    assert 5.5 * GiB < peak < 6.5 * GiB
    assert host_heap(twin, 2, memory=22 * GiB).memory.host_heap == "return"  # 11.8 GiB > 11 GiB a rank
    assert host_heap(twin, 2, memory=32 * GiB).memory.host_heap == "keep"
    assert host_heap(twin, 1, memory=24 * GiB).memory.host_heap == "keep"  # one rank (cp 2 still planned)
    demo = load_config("demo-cpu", [])
    assert host_heap(demo, 1, memory=8 * GiB).memory.host_heap == "keep"


def test_a_chosen_policy_is_left_alone():
    twin = load_config("hg38-twin-cpu", ["memory.host_heap=keep"])
    assert host_heap(twin, 2, memory=24 * GiB).memory.host_heap == "keep"
