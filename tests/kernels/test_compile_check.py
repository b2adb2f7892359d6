"""The GPU kernels compiled for Hopper (sm_90) and Blackwell (sm_100) on this CPU machine, at the
per-rank shapes of the shipped configs (TP 8: 8 KDA heads x 128, 8 MLA heads on the 512-channel
latent or 256/256 per head, the indexer's 32 x 128): none over the shared-memory limit, none
spilling (the fp32 parity mode may spill, never exceed the shared memory), the tensor-core
kernels using tensor-core instructions, each compiling in under a minute. The full sweep (64
heads too) is ``genome-lm bench kernels --compile-for sm_90,sm_100``.

The registers, spills and stack frame are ``ptxas -v``'s, run the way Triton runs it (the bundled
ptxas, ptxas-blackwell from sm_100 on, for sm_90a / sm_100a): the tests below parse real ptxas
output and compare the check's figures with ptxas run by hand on the same PTX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from genome_lm_kernels.compile_check import (
    SHARED_LIMIT,
    TARGETS,
    KernelReport,
    PtxasUsage,
    parse_ptxas_log,
    ptx_path,
    ptxas_usage,
    run_in_subprocess,
)

KDA_KERNELS = {"_cumsum_kernel", "_intra_kernel", "_solve_kernel", "_state_kernel", "_output_kernel",
               "_state_bwd_kernel", "_dqkw_kernel", "_intra_bwd_kernel"}
CUDA_CORE_ONLY = {"_cumsum_kernel", "_attn_fwd", "_attn_bwd"}  # a scan, and the per-head attention


def _ptxas_binary(arch: int) -> Path | None:
    """The bundled ptxas Triton uses for ``arch``: ptxas-blackwell from sm_100 on."""
    try:
        from triton.backends import nvidia
    except ImportError:
        return None
    return Path(nvidia.__file__).parent / "bin" / ("ptxas-blackwell" if arch >= 100 else "ptxas")


def _ptxas_v_by_hand(ptx: Path, arch: int, tmp: Path) -> str:
    """``ptxas -v`` on ``ptx`` with the flags Triton 3.7's ``make_cubin`` passes (line info, its
    register-allocation workaround, the arch-specific target), run directly."""
    cmd = [str(_ptxas_binary(arch)), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{arch}a",
           str(ptx), "-o", str(tmp / "by_hand.cubin")]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


needs_ptxas = pytest.mark.skipif(not all((p := _ptxas_binary(a)) and p.exists() for a in TARGETS.values()),
                                 reason="triton's bundled ptxas is not installed")


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ptx")


@pytest.fixture(scope="module")
def reports(ptx_dir):
    return run_in_subprocess(list(TARGETS), "kda,dsa", kda_heads="8", dsa_heads="8", ptx_dir=ptx_dir, timeout_s=1800)


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
            assert r["spill_stores"] == r["spill_loads"] == r["local_bytes"] == 0, \
                f"{r['target']} {r['case']} {r['kernel']} spills"
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
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]

    (row,) = json.loads(out.stdout)
    assert row["shared"] > SHARED_LIMIT[90]
    assert any("shared memory" in p for p in row["problems"])


def test_refuses_to_run_under_the_interpreter(monkeypatch):
    from genome_lm_kernels.compile_check import compiling_for

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"), compiling_for("sm_90", "x", []):
        pass


# ptxas -v as Triton 3.6's bundled ptxas-blackwell (CUDA 12.9) printed it for KDA's _dqkw_kernel
# at BK 16, BV 64, 8 warps on sm_100a, and Triton 3.7's ptxas (CUDA 12.8) for the shipped tiles on
# sm_90a: the first spills 12 B while its stack frame is 16 B.
PTXAS_SM100A_SPILLS = """\
ptxas-blackwell info    : 0 bytes gmem
ptxas-blackwell info    : Compiling entry function '_dqkw_kernel' for 'sm_100a'
ptxas-blackwell info    : Function properties for _dqkw_kernel
    16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
ptxas-blackwell info    : Used 128 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas-blackwell info    : Compile time = 806.239 ms
"""
PTXAS_SM90A_CLEAN = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_dqkw_kernel' for 'sm_90a'
ptxas info    : Function properties for _dqkw_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compile time = 1112.023 ms
"""


def test_parses_ptxas_v_output():
    assert parse_ptxas_log(PTXAS_SM100A_SPILLS) == {"_dqkw_kernel": PtxasUsage("sm_100a", 128, 16, 12, 12)}
    assert parse_ptxas_log(PTXAS_SM90A_CLEAN) == {"_dqkw_kernel": PtxasUsage("sm_90a", 255, 0, 0, 0)}
    # two entries and a device function's properties (no entry of its own) in one log
    both = PTXAS_SM90A_CLEAN + PTXAS_SM90A_CLEAN.replace("_dqkw_kernel", "_other") + (
        "ptxas info    : Function properties for helper\n    8 bytes stack frame, 4 bytes spill stores, "
        "4 bytes spill loads\n")
    assert set(parse_ptxas_log(both)) == {"_dqkw_kernel", "_other"}
    with pytest.raises(ValueError, match="_dqkw_kernel"):
        parse_ptxas_log(PTXAS_SM100A_SPILLS.replace("Used 128 registers", "Used registers"))


def _report(**kw) -> KernelReport:
    row = {"target": "sm_100", "case": "kda", "kernel": "_dqkw_kernel", "shared_bytes": 49_152, "registers": 128,
           "local_bytes": 16, "compile_s": 1.0, "num_warps": 8, "num_stages": 1, "mma": 42, "spill_stores": 12,
           "spill_loads": 12, "ptxas_arch": "sm_100a", "cubin_registers": 128, "cubin_local_bytes": 16}
    return KernelReport(**{**row, **kw})


def test_a_spilling_kernel_is_a_problem_unless_parity_only():
    assert _report().problems == ["spills 12 B stores, 12 B loads per thread (16 B stack frame, ptxas -v for sm_100a)"]
    assert _report(parity_only=True).problems == []
    assert _report(spill_stores=0, spill_loads=0, local_bytes=0, cubin_local_bytes=0).problems == []
    # local memory without spills (a local array) is local memory all the same
    assert "16 B of local memory" in _report(spill_stores=0, spill_loads=0).problems[0]
    # figures that are not those of Triton's own cubin are reported, parity mode or not
    assert "disagrees" in _report(parity_only=True, cubin_registers=130).problems[0]


TINY_PTX = """\
.version {version}
.target sm_{arch}a
.address_size 64

.visible .entry tiny(.param .u64 p)
{{
\t.local .align 4 .b8 buf[64];
\t.reg .b32 %r<4>;
\t.reg .b64 %rd<8>;
\tld.param.u64 %rd1, [p];
\tcvta.to.global.u64 %rd2, %rd1;
\tld.global.u32 %r1, [%rd2];
\tand.b32 %r2, %r1, 15;
\tmul.wide.u32 %rd3, %r2, 4;
\tmov.u64 %rd4, buf;
\tcvta.local.u64 %rd5, %rd4;
\tadd.s64 %rd6, %rd5, %rd3;
\tst.u32 [%rd6], %r1;
\tld.u32 %r3, [%rd5];
\tst.global.u32 [%rd2], %r3;
\tret;
}}
"""


@needs_ptxas
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_ptxas_usage_equals_ptxas_v_by_hand(target, tmp_path):
    """The check's ptxas run (through Triton's make_cubin) and ptxas run directly give the same
    figures for a small kernel with a 64-byte local array (a stack frame without spills)."""
    arch = TARGETS[target]
    ptx = tmp_path / "tiny.ptx"
    ptx.write_text(TINY_PTX.format(version="8.0" if arch < 100 else "8.7", arch=arch))
    usage = ptxas_usage(ptx.read_text(), arch)
    assert usage == parse_ptxas_log(_ptxas_v_by_hand(ptx, arch, tmp_path))["tiny"]
    assert (usage.arch, usage.stack_bytes, usage.spill_stores) == (f"sm_{arch}a", 64, 0)


@pytest.mark.slow
@needs_ptxas
def test_the_check_counts_spills_as_ptxas_v_does(tmp_path):
    """A kernel that holds a [32, 256] fp32 tile in one warp spills on both targets: the check's
    registers, spill stores, spill loads and stack frame are what ptxas -v says of its PTX, run
    by hand, and the spill is a problem (it is not the parity mode)."""
    script = tmp_path / "spills.py"
    script.write_text(textwrap.dedent('''
        import json, sys, torch, triton, triton.language as tl
        from dataclasses import asdict
        from genome_lm_kernels.compile_check import compiling_for

        @triton.jit
        def held(x_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr):
            at = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
            x = tl.load(x_ptr + at)
            norm = tl.sqrt(tl.sum(x * x, axis=1))
            tl.store(y_ptr + at, x / norm[:, None])

        reports = []
        for target in ("sm_90", "sm_100"):
            with compiling_for(target, "held", reports, ptx_dir=sys.argv[1]):
                held[(1,)](torch.empty(32, 256), torch.empty(32, 256), M=32, N=256, num_warps=1)
        json.dump([dict(asdict(r), problems=r.problems) for r in reports], sys.stdout)
    '''))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ptx")], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [r["target"] for r in rows] == ["sm_90", "sm_100"]
    for r in rows:
        arch = TARGETS[r["target"]]
        by_hand = parse_ptxas_log(_ptxas_v_by_hand(tmp_path / "ptx" / r["target"] / "held" / "held.ptx", arch,
                                                   tmp_path))["held"]
        assert (r["ptxas_arch"], r["registers"], r["spill_stores"], r["spill_loads"], r["local_bytes"]) == (
            by_hand.arch, by_hand.registers, by_hand.spill_stores, by_hand.spill_loads, by_hand.stack_bytes)
        assert r["spill_stores"] > 0 and r["spill_loads"] > 0
        assert (r["cubin_registers"], r["cubin_local_bytes"]) == (r["registers"], r["local_bytes"])
        assert any(p.startswith("spills") for p in r["problems"]), r["problems"]


@pytest.mark.slow
@needs_ptxas
def test_every_kernel_agrees_with_ptxas_v_by_hand(reports, ptx_dir, tmp_path):
    """Each shipped kernel's registers, spills and stack frame in the report are ptxas -v's for
    its PTX, run by hand for sm_90a / sm_100a (KDA's _dqkw_kernel among them)."""
    assert any(r["kernel"] == "_dqkw_kernel" for r in reports)
    for r in reports:
        arch = TARGETS[r["target"]]
        ptx = ptx_path(ptx_dir, r["target"], r["case"], r["kernel"])
        by_hand = parse_ptxas_log(_ptxas_v_by_hand(ptx, arch, tmp_path))[r["kernel"]]
        got = (r["ptxas_arch"], r["registers"], r["spill_stores"], r["spill_loads"], r["local_bytes"])
        assert got == (by_hand.arch, by_hand.registers, by_hand.spill_stores, by_hand.spill_loads,
                       by_hand.stack_bytes), f"{r['target']} {r['case']} {r['kernel']}"


GATHER_KERNELS = {"_attn_fwd", "_attn_bwd", "_mla_fwd", "_mla_bwd"}  # they read a selection's token indices


@pytest.mark.slow
@needs_ptxas
def test_int32_selections_are_widened_before_the_row_offsets(reports, ptx_dir):
    """The selections are int32 (``genome_lm_kernels.dsa.indexer.SELECTION_DTYPE``); at 1M tokens a
    row offset (token x heads x width) passes 2^31, so the kernels that gather the selected rows
    must form it in int64. In each one's Triton IR, compiled for sm_90 and sm_100 at the shipped
    shapes with int32 indices: the indices are loaded through an i32 pointer, sign-extended to
    i64, and every pointer added to a column of selected rows ([n x 1] pointers) is offset by
    i64 values (an i32 offset there would wrap)."""
    import re

    checked = 0
    for r in reports:
        if r["kernel"] not in GATHER_KERNELS:
            continue
        ir = ptx_path(ptx_dir, r["target"], r["case"], r["kernel"]).with_suffix(".ttir").read_text()
        where = f"{r['target']} {r['case']} {r['kernel']}"
        assert re.search(r"tt\.load %\S+(, %\S+)* : tensor<\d+x!tt\.ptr<i32>>", ir), where
        assert re.search(r"arith\.extsi %\S+ : tensor<\d+xi32> to tensor<\d+xi64>", ir), where
        row_columns = re.findall(r"tt\.addptr %\S+, %\S+ : tensor<\d+x1x!tt\.ptr<\w+>>, tensor<(\d+x1x\w+)>", ir)
        assert row_columns and all(t.endswith("i64") for t in row_columns), (where, row_columns)
        checked += 1
    assert checked >= 4 * len(TARGETS), checked
