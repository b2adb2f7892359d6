"""The planner's peak for one training step of the tiny model against the measured peak on this
CPU (resident-set high-water mark of a warmed-up fresh process, see ``genome_lm.plan.measure``):
within 15% at several lengths, with each memory technique on and off. Nested recompute is the
exception: the plan is x1.32-1.40 of the measured peak at 4k-16k (about 6.5 KiB per token too
many, cause not pinned down: the plan counts a block's recomputed tensors, its mHC tensors and
the stream gradients all alive at once), so the test checks that it is an upper bound within
1.5x."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from genome_lm.config import load_config
from genome_lm.plan.measure import measure_step
from genome_lm.plan.memory_model import with_changes
from genome_lm.plan.sweep import predicted_step

CASES = [
    (8192, "plain", {}),
    (4096, "full recompute", {"recompute": "full"}),
    (8192, "full recompute", {"recompute": "full"}),
    (4096, "selective attention", {"recompute": "selective", "recompute_modules": ["attention"]}),
    (4096, "selective mlp+moe", {"recompute": "selective", "recompute_modules": ["mlp", "moe"]}),
    (4096, "moe chunks + offload", {"moe_chunks": 4, "offload_activations": True}),
    (8192, "DSA query chunk 8192 + full recompute", {"dsa_query_chunk": 8192, "recompute": "full"}),
    (8192, "MoE chunks recomputed", {"moe_chunks": 4, "moe_chunk_recompute": True}),
]
NESTED = (8192, "nested full recompute", {"recompute": "full", "recompute_nested": True})


@pytest.mark.slow
def test_predicted_peak_within_15_percent_of_measured():
    base = load_config("demo-cpu", ["train.global_batch_size=1"])
    runs = [with_changes(base, data={"seq_len": T}, memory=mem) for T, _, mem in CASES + [NESTED]]
    with ThreadPoolExecutor(2) as pool:  # each measurement is its own process
        measured = list(pool.map(measure_step, runs))
    report = []
    for (T, name, _), run, got in zip(CASES + [NESTED], runs, measured):
        want = predicted_step(run)
        report.append(f"{name} T={T}: predicted {want / 2**20:.0f} MiB, measured {got.peak_bytes / 2**20:.0f} MiB, "
                      f"x{want / got.peak_bytes:.2f}")
    print("\n".join(report))
    for line, (T, name, _), run, got in zip(report, CASES, runs, measured):
        assert predicted_step(run) == pytest.approx(got.peak_bytes, rel=0.15), line
    assert measured[-1].peak_bytes <= predicted_step(runs[-1]) <= 1.5 * measured[-1].peak_bytes, report[-1]
    # the techniques do what the plan says: full recompute at least halves the 8k peak, and
    # nesting the blocks' checkpoints inside it lowers it further
    assert measured[2].peak_bytes < 0.5 * measured[0].peak_bytes
    assert measured[-2].peak_bytes < 0.9 * measured[0].peak_bytes  # MoE chunks recomputed, against plain
    assert measured[-1].peak_bytes < 0.8 * measured[2].peak_bytes
