"""``genome-lm bench kernels`` (genome_lm.compare.kernels) at tiny sizes: every KDA implementation
and mode comes back measured from its fresh process (or extrapolated past its cap), the DSA rows
for both paths, and the table's ratios are against the baselines."""

import math

import pytest

from genome_lm.compare.bench import kernel_bench
from genome_lm.compare.kernels import dsa_bench, kda_bench


@pytest.mark.slow  # one fresh process per implementation and mode (torch and transformers imports)
def test_kda_rows_measured_or_extrapolated():
    rows = kda_bench(lengths=(64, 128), heads=2, head_dim=16, backward=True, reference_max_len=64,
                     transformers_max_len=64, timeout_s=300)
    seen = {(r["impl"], r["mode"], r["T"]): r for r in rows}
    assert set(seen) == {(impl, mode, T) for impl in ("torch", "reference", "transformers")
                         for mode in ("forward", "forward+backward") for T in (64, 128)
                         if not (impl == "transformers" and mode != "forward")}
    for (impl, mode, T), row in seen.items():
        assert row["note"] == ("measured" if T == 64 or impl == "torch" else "extrapolated from T=64"), row
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0 and row["peak_mib"] >= 0
        assert row["tokens_per_s"] == pytest.approx(T / row["seconds"])


def test_dsa_rows_and_ratios():
    rows = dsa_bench(lengths=(256,), heads=2, head_dim=16, idx_heads=2, idx_dim=16, topk=64, threads=1)
    assert {r["path"] for r in rows} == {"sparse", "dense"} and not any(r["skipped"] for r in rows)
    assert all(r["time_s"] > 0 and r["peak_bytes"] >= 0 for r in rows)
    table = kernel_bench("dsa", (256,))["dsa"]
    sparse = next(r for r in table if r["path"] == "sparse")
    assert sparse["x sparse time"] == pytest.approx(1.0)
