"""The GPU kernels compiled for Hopper (sm_90) and Blackwell (sm_100) on this CPU machine, at the
per-rank shapes of the shipped configs (TP 8: 8 KDA heads x 128, 8 MLA heads on the 512-channel
latent or 256/256 per head, the indexer's 32 x 128): none over the shared-memory limit, none
spilling (the fp32 parity mode may spill, never exceed the shared memory), the tensor-core
kernels using tensor-core instructions, each compiling in under a minute. The full sweep (64
heads too) is ``genome-lm bench kernels --compile-for sm_90,sm_100``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from genome_lm_kernels.compile_check import SHARED_LIMIT, TARGETS, run_in_subprocess

KDA_KERNELS = {"_cumsum_kernel", "_intra_kernel", "_solve_kernel", "_state_kernel", "_output_kernel",
               "_state_bwd_kernel", "_dqkw_kernel", "_intra_bwd_kernel"}
CUDA_CORE_ONLY = {"_cumsum_kernel", "_attn_fwd", "_attn_bwd"}  # a scan, and the per-head attention


@pytest.fixture(scope="module")
def reports():
    return run_in_subprocess(list(TARGETS), "kda,dsa", kda_heads="8", dsa_heads="8", timeout_s=1800)


@pytest.mark.slow
def test_every_kernel_fits_the_target(reports):
    for target in TARGETS:
        rows = [r for r in reports if r["target"] == target]
        assert {r["kernel"] for r in rows if r["case"].startswith("kda triton ")} == KDA_KERNELS
        assert {r["kernel"] for r in rows if r["case"].startswith("sparse mla")} == {"_mla_fwd", "_mla_bwd"}
        assert {r["kernel"] for r in rows if r["case"].startswith("dsa ")} == {"_attn_fwd", "_attn_bwd", "_pool_scores"}
    problems = [f"{r['target']} {r['case']} {r['kernel']}: {r['problems']}" for r in reports if r["problems"]]
    assert not problems, problems
    for r in reports:
        assert r["shared_bytes"] <= SHARED_LIMIT[TARGETS[r["target"]]]
        assert r["compile_s"] < 60, f"{r['kernel']} took {r['compile_s']} s to compile"
        fast = "triton-fp32" not in r["case"]
        if fast:
            assert r["local_bytes"] == 0, f"{r['target']} {r['case']} {r['kernel']} spills"
        if fast and r["kernel"] not in CUDA_CORE_ONLY:
            assert r["mma"] > 0, f"{r['target']} {r['case']} {r['kernel']} has no tensor-core instruction"


@pytest.mark.slow
def test_the_check_reports_a_kernel_that_cannot_launch(tmp_path):
    """A kernel that asks for more shared memory than a Hopper block has is reported as a
    problem: the check can fail."""
    script = tmp_path / "oversized.py"
    script.write_text(textwrap.dedent('''
        import json, sys, torch, triton, triton.language as tl
        from genome_lm_kernels.compile_check import compiling_for

        @triton.jit
        def big(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
            m, n = tl.arange(0, M), tl.arange(0, N)
            acc = tl.zeros([M, N], dtype=tl.float32)
            for k0 in range(0, 4096, K):
                k = k0 + tl.arange(0, K)
                a = tl.load(a_ptr + m[:, None] * 4096 + k[None, :])
                b = tl.load(b_ptr + k[:, None] * N + n[None, :])
                acc += tl.dot(a, b)
            tl.store(c_ptr + m[:, None] * N + n[None, :], acc)

        reports = []
        a = torch.empty(256, 4096, dtype=torch.bfloat16)
        b = torch.empty(4096, 256, dtype=torch.bfloat16)
        c = torch.empty(256, 256)
        with compiling_for("sm_90", "oversized", reports):
            big[(1,)](a, b, c, M=256, N=256, K=256, num_stages=4)
        json.dump([dict(shared=r.shared_bytes, problems=r.problems) for r in reports], sys.stdout)
    '''))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    (row,) = json.loads(out.stdout)
    assert row["shared"] > SHARED_LIMIT[90]
    assert any("shared memory" in p for p in row["problems"])


def test_refuses_to_run_under_the_interpreter(monkeypatch):
    from genome_lm_kernels.compile_check import compiling_for

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        with compiling_for("sm_90", "x", []):
            pass
