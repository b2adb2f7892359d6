"""Compile every Triton kernel for a GPU this machine does not have, and report what each needs.

Triton compiles for any target its bundled ptxas knows. A stand-in driver tells it the target
(``GPUTarget("cuda", 90, 32)`` for Hopper) and answers device and stream queries with 0; while
``compiling_for`` is active, every ``kernel[grid](...)`` of the project's own launch code compiles
with the real argument specialisation (``warmup=True``) and launches nothing. Per kernel that
gives the shared memory per block Triton will ask for (``metadata.shared``), the compile time, and
what ``ptxas -v`` says of the kernel: registers per thread, spill stores and spill loads (bytes
per thread) and the stack frame (local memory per thread: spill slots and local arrays). Those
come from ptxas run the way Triton runs it when it builds the cubin: the PTX goes through the
nvidia backend's own ``make_cubin`` again (the same bundled binary, ``ptxas-blackwell`` from
sm_100 on, the same flags, ``--gpu-name=sm_90a`` / ``sm_100a``) with Triton's
``TRITON_DUMP_PTXAS_LOG`` switch on, and the log is parsed. The registers and stack frame are
checked against the cubin Triton built (``cuobjdump -res-usage``), so the figures are those of
the binary that would launch. ``ptx_dir`` keeps each kernel's PTX, to rerun ptxas by hand.

The launch code runs on CPU tensors of the real shapes: kernels are never launched, so their
outputs hold garbage that only later launches read, which is harmless for compiling.
Run it in a process without ``TRITON_INTERPRET`` (triton reads that when a kernel is defined):
``python -m genome_lm_kernels.compile_check --target sm_90`` or ``genome-lm bench kernels
--compile-for sm_90,sm_100``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Per block shared memory a kernel may opt into, and registers per thread (H100/H200 sm_90a,
# B200 sm_100a: both 227 KiB per block, 255 registers per thread).
TARGETS = {"sm_90": 90, "sm_100": 100}
SHARED_LIMIT = {90: 232_448, 100: 232_448}
MAX_REGISTERS = 255


@dataclass(frozen=True)
class PtxasUsage:
    """What ``ptxas -v`` reports for one entry function; bytes are per thread."""

    arch: str  # the --gpu-name ptxas compiled for: sm_90a, sm_100a
    registers: int  # "Used N registers"
    stack_bytes: int  # "N bytes stack frame": local memory (spill slots, local arrays)
    spill_stores: int  # "N bytes spill stores"
    spill_loads: int  # "N bytes spill loads"


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PTXAS_PROPERTIES = re.compile(r"Function properties for (\S+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> dict[str, PtxasUsage]:
    """Per entry function of a ``ptxas -v`` log (ptxas or ptxas-blackwell), its registers, stack
    frame and spill stores/loads. Device functions (properties without an entry) are left out."""
    entries: dict[str, dict] = {}
    frames: dict[str, tuple[int, int, int]] = {}
    entry = properties = None
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            entry = m.group(1)
            entries[entry] = {"arch": m.group(2)}
        elif m := _PTXAS_PROPERTIES.search(line):
            properties = m.group(1)
        elif (m := _PTXAS_FRAME.search(line)) and properties is not None:
            frames[properties] = tuple(int(g) for g in m.groups())
        elif (m := _PTXAS_REGISTERS.search(line)) and entry is not None:
            entries[entry]["registers"] = int(m.group(1))
    out = {}
    for name, e in entries.items():
        if "registers" not in e or name not in frames:
            raise ValueError(f"ptxas -v log without the registers or stack frame of {name}:\n{log}")
        stack, stores, loads = frames[name]
        out[name] = PtxasUsage(e["arch"], e["registers"], stack, stores, loads)
    return out


def _hashable(v):
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def ptxas_usage(ptx: str, arch: int, options: dict | None = None) -> PtxasUsage:
    """``ptxas -v`` of the kernel in ``ptx`` for compute capability ``arch``, run as Triton runs
    it: through the nvidia backend's ``make_cubin`` (its choice of binary and flags) with
    ``TRITON_DUMP_PTXAS_LOG`` on. ``options``: the kernel's compile options (its metadata), which
    decide flags such as ``--fmad=false`` and ``TRITON_PTXAS_OPTIONS``' extra flags."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch, 32))
    opts = {k: _hashable(v) for k, v in (options or {}).items() if v is not None and k not in ("arch", "target")}
    opt = backend.parse_options(opts)
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        backend.make_cubin(ptx, {}, opt, arch)
    names = re.findall(r"\.visible \.entry (\w+)", ptx)
    usage = parse_ptxas_log(log.getvalue())
    if len(names) != 1 or names[0] not in usage:
        raise RuntimeError(f"no ptxas -v figures for the entry {names} in:\n{log.getvalue()}")
    return usage[names[0]]


@dataclass
class KernelReport:
    target: str
    case: str  # which op at which shape
    kernel: str
    shared_bytes: int
    registers: int  # per thread (ptxas -v)
    local_bytes: int  # per thread: ptxas -v's stack frame (spill slots and local arrays; 0 when nothing spills)
    compile_s: float
    num_warps: int
    num_stages: int
    mma: int  # tensor-core instructions in the PTX (wgmma / mma / tcgen05.mma); 0: CUDA cores only
    parity_only: bool = False  # the fp32 parity mode: spills are reported, not a failure
    spill_stores: int = 0  # bytes per thread (ptxas -v)
    spill_loads: int = 0  # bytes per thread (ptxas -v)
    ptxas_arch: str = ""  # the --gpu-name ptxas compiled for (sm_90a, sm_100a)
    cubin_registers: int | None = None  # of the cubin Triton built (cuobjdump), to check the above
    cubin_local_bytes: int | None = None

    @property
    def problems(self) -> list[str]:
        """What stops the kernel from launching or running at speed on the target."""
        out = []
        if self.shared_bytes > SHARED_LIMIT[TARGETS[self.target]]:
            out.append(f"shared memory {self.shared_bytes:,} B > {SHARED_LIMIT[TARGETS[self.target]]:,} B")
        if (self.spill_stores or self.spill_loads) and not self.parity_only:
            out.append(f"spills {self.spill_stores} B stores, {self.spill_loads} B loads per thread"
                       f" ({self.local_bytes} B stack frame, ptxas -v for {self.ptxas_arch})")
        elif self.local_bytes and not self.parity_only:
            out.append(f"{self.local_bytes} B of local memory per thread (stack frame, ptxas -v for {self.ptxas_arch})")
        if self.cubin_registers is not None and (self.cubin_registers, self.cubin_local_bytes) != (
                self.registers, self.local_bytes):
            out.append(f"ptxas -v ({self.registers} registers, {self.local_bytes} B stack) disagrees with Triton's "
                       f"cubin ({self.cubin_registers} registers, {self.cubin_local_bytes} B local)")
        return out


class _StandInDriver:
    """Just enough of a Triton driver to compile for ``arch`` without a GPU. Each target gets its
    own device number, so Triton's per-device kernel caches never hand one target's binary to another."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self):
        return self.arch

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


def _cuobjdump() -> str:
    from triton.backends import nvidia

    return str(Path(nvidia.__file__).parent / "bin" / "cuobjdump")


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local bytes per thread: stack and local) of a compiled kernel, from its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    local = int(re.search(r"LOCAL:(\d+)", out).group(1)) + int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, local


def ptx_path(ptx_dir: str | Path, target: str, case: str, kernel: str) -> Path:
    """Where ``compiling_for(..., ptx_dir=...)`` keeps a kernel's PTX."""
    return Path(ptx_dir) / target / re.sub(r"[^\w.-]+", "_", case) / f"{kernel}.ptx"


@contextlib.contextmanager
def compiling_for(target: str, case: str, reports: list[KernelReport], parity_only: bool = False,
                  ptx_dir: str | Path | None = None):
    """Within the block, kernel launches compile for ``target`` (e.g. "sm_90") and append a
    KernelReport per distinct compiled kernel to ``reports``; nothing is launched. With
    ``ptx_dir``, each kernel's PTX is kept there as ``<target>/<case>/<kernel>.ptx``, its Triton IR
    beside it as ``.ttir``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the compile check needs a process without TRITON_INTERPRET=1")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    arch = TARGETS[target]
    seen = {(r.target, r.case, r.kernel) for r in reports}
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        seconds = time.perf_counter() - start
        name = self.fn.__name__
        if (target, case, name) not in seen:
            seen.add((target, case, name))
            ptx = kernel.asm["ptx"]
            if ptx_dir is not None:
                where = ptx_path(ptx_dir, target, case, name)
                where.parent.mkdir(parents=True, exist_ok=True)
                where.write_text(ptx)
                where.with_suffix(".ttir").write_text(kernel.asm["ttir"])  # typed IR: the index arithmetic's widths
            usage = ptxas_usage(ptx, arch, kernel.metadata._asdict())
            cubin_regs, cubin_local = resource_usage(kernel.asm["cubin"])
            mma = len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)\b", ptx,
                                 re.MULTILINE))
            reports.append(KernelReport(
                target, case, name, kernel.metadata.shared, usage.registers, usage.stack_bytes, round(seconds, 2),
                kernel.metadata.num_warps, kernel.metadata.num_stages, mma, parity_only,
                spill_stores=usage.spill_stores, spill_loads=usage.spill_loads, ptxas_arch=usage.arch,
                cubin_registers=cubin_regs, cubin_local_bytes=cubin_local))
        return kernel

    previous = driver._active  # None on a machine without a GPU (reset_active would fail there)
    driver.set_active(_StandInDriver(arch))
    JITFunction.run = compile_only
    try:
        yield
    finally:
        JITFunction.run = real_run
        driver._active = previous


# --- the real per-rank shapes of the shipped configs ------------------------------------------

def kda_cases(T: int = 2048) -> list[dict]:
    """KDA at glm5_next's head size, 64 heads (TP 1) and 8 (TP 8); both precisions; the dtypes
    the model passes (q, k fp32 after l2norm, v in the model's bf16, g and beta fp32)."""
    return [{"op": "kda", "H": H, "K": 128, "V": 128, "T": T, "backend": b}
            for H in (64, 8) for b in ("triton", "triton-fp32")]


def dsa_cases(T: int = 4096) -> list[dict]:
    """DSA at glm5_next's sizes, 64 heads (TP 1) and 8 (TP 8): the attention over the selected
    tokens on the shared 512-channel latent (absorbed MLA, both precisions) and per head with
    qk 256 / v 256 (the non-absorbed kernels); the indexer 32 heads x 128, k-pool 4, top-k 2048."""
    mla = [{"op": "mla", "H": H, "D": 512, "DV": 512, "T": T, "topk": 2048, "kpool": 4, "backend": b}
           for H in (64, 8) for b in ("triton", "triton-fp32")]
    return mla + [{"op": "dsa", "H": H, "D": 256, "DV": 256, "T": T, "Hi": 32, "Di": 128, "kpool": 4, "topk": 2048}
                  for H in (64, 8)]


def case_name(case: dict) -> str:
    if case["op"] == "kda":
        return f"kda {case['backend']} H{case['H']} K{case['K']} V{case['V']}"
    if case["op"] == "mla":
        return f"sparse mla {case['backend']} H{case['H']} D{case['D']}/{case['DV']} top{case['topk']}"
    return (f"dsa H{case['H']} D{case['D']}/{case['DV']} idx {case['Hi']}x{case['Di']} kpool{case['kpool']} "
            f"top{case['topk']}")


def _run_case(case: dict) -> None:
    """Forward and backward of one op through its public launch code, on CPU tensors."""
    g = torch.Generator().manual_seed(0)
    if case["op"] == "kda":
        from genome_lm_kernels.kda.triton import kda_triton

        B, T, H, K, V = 1, case["T"], case["H"], case["K"], case["V"]
        q, k, gg = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
        v = torch.randn(B, T, H, V, generator=g).bfloat16()
        beta = torch.rand(B, T, H, generator=g)
        leaves = [x.requires_grad_() for x in (q, k, v, gg, beta)]
        o, S = kda_triton(*leaves, K**-0.5, None, exact=case["backend"] == "triton-fp32")
        torch.autograd.grad((o.sum() + S.sum()), leaves)
        return
    if case["op"] == "mla":
        from genome_lm_kernels.dsa.triton_mla import sparse_mla

        B, T, H = 1, case["T"], case["H"]
        q = torch.randn(B, T, H, case["D"], generator=g).bfloat16().requires_grad_()
        kv = torch.randn(B, T, case["D"], generator=g).bfloat16().requires_grad_()
        # int32, as the model's selections are
        idx = torch.randint(0, T, (B, T, case["topk"] + case["kpool"] - 1), generator=g, dtype=torch.int32)
        o, _lse = sparse_mla(q, kv, idx, scale=case["D"] ** -0.5, dv=case["DV"], exact=case["backend"] == "triton-fp32")
        torch.autograd.grad(o.float().sum(), (q, kv))
        return
    from genome_lm_kernels.dsa import triton as dsa_triton

    B, T, H = 1, case["T"], case["H"]
    q = torch.randn(B, T, H, case["D"], generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, T, H, case["D"], generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, T, H, case["DV"], generator=g).bfloat16().requires_grad_()
    S = case["topk"] + case["kpool"] - 1
    idx = torch.randint(0, T, (B, T, S), generator=g, dtype=torch.int32)
    o, _lse = dsa_triton.sparse_attention(q, k, v, idx, scale=case["D"] ** -0.5)
    torch.autograd.grad(o.float().sum(), (q, k, v))
    N = T // case["kpool"]
    qi = torch.randn(B, 64, case["Hi"], case["Di"], generator=g).bfloat16()
    kp = torch.randn(B, N, case["Di"], generator=g).bfloat16()
    w = torch.randn(B, 64, case["Hi"], generator=g)
    dsa_triton.pool_scores_chunk(qi, kp, w, 0, case["Di"] ** -0.5, case["kpool"])


def check(targets: list[str], cases: list[dict], use_triton_cache: bool = False,
          ptx_dir: str | Path | None = None) -> list[KernelReport]:
    """Compile every kernel of ``cases`` for each target. A fresh Triton cache makes the compile
    times real; ``use_triton_cache`` compiles into (and reuses) Triton's own cache instead.
    ``ptx_dir``: keep each kernel's PTX there (see ``compiling_for``)."""
    reports: list[KernelReport] = []
    with tempfile.TemporaryDirectory() as tmp:
        if not use_triton_cache:
            os.environ["TRITON_CACHE_DIR"] = tmp
        for target in targets:
            for case in cases:
                with compiling_for(target, case_name(case), reports, case.get("backend") == "triton-fp32", ptx_dir):
                    _run_case(case)
    return reports


def run_in_subprocess(targets: list[str], ops: str = "kda,dsa", *, kda_heads: str | None = None,
                      kda_backends: str | None = None, dsa_heads: str | None = None,
                      use_triton_cache: bool = False, ptx_dir: str | Path | None = None,
                      timeout_s: int = 3600) -> list[dict]:
    """``check`` in a fresh Python without TRITON_INTERPRET (tests and the CLI may have it set);
    returns the report rows as dicts, each with its ``problems``."""
    args = [sys.executable, "-m", "genome_lm_kernels.compile_check", "--ops", ops]
    for t in targets:
        args += ["--target", t]
    for flag, value in (("--kda-heads", kda_heads), ("--kda-backends", kda_backends), ("--dsa-heads", dsa_heads)):
        if value:
            args += [flag, value]
    if use_triton_cache:
        args.append("--use-triton-cache")
    if ptx_dir is not None:
        args += ["--ptx-dir", str(ptx_dir)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reports.json"
        proc = subprocess.run(args + ["--json", str(out)], env=env, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        if proc.returncode not in (0, 1) or not out.exists():  # 1: it ran, and some kernel has a problem
            raise RuntimeError(f"the compile check failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), required=True)
    parser.add_argument("--ops", default="kda,dsa", help="comma-separated: kda, dsa")
    parser.add_argument("--kda-heads", default=None, help="only these KDA head counts (e.g. 8)")
    parser.add_argument("--kda-backends", default=None, help="only these KDA backends (triton, triton-fp32)")
    parser.add_argument("--dsa-heads", default=None, help="only these DSA head counts")
    parser.add_argument("--json", default=None, help="write the reports here")
    parser.add_argument("--use-triton-cache", action="store_true",
                        help="compile into Triton's own cache (warm: cache hits) instead of a fresh one")
    parser.add_argument("--ptx-dir", default=None,
                        help="keep each kernel's PTX here (<target>/<case>/<kernel>.ptx), to rerun ptxas -v on it")
    args = parser.parse_args(argv)
    ops = set(args.ops.split(","))
    cases = (kda_cases() if "kda" in ops else []) + (dsa_cases() if "dsa" in ops else [])
    if "mla" in ops and "dsa" not in ops:
        cases += [c for c in dsa_cases() if c["op"] == "mla"]

    def keep(case):
        if case["op"] == "kda":
            return ((args.kda_heads is None or str(case["H"]) in args.kda_heads.split(","))
                    and (args.kda_backends is None or case["backend"] in args.kda_backends.split(",")))
        return ((args.dsa_heads is None or str(case["H"]) in args.dsa_heads.split(","))
                and (args.kda_backends is None or case.get("backend", "triton") in args.kda_backends.split(",")))

    reports = check(args.target, [c for c in cases if keep(c)], use_triton_cache=args.use_triton_cache,
                    ptx_dir=args.ptx_dir)
    rows = [dict(asdict(r), problems=r.problems) for r in reports]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['target']:7} {r['case']:34} {r['kernel']:20} shared {r['shared_bytes']:>7,} B  "
              f"regs {r['registers']:>3}"
              f"  spill st {r['spill_stores']:>5} B ld {r['spill_loads']:>5} B  stack {r['local_bytes']:>5} B"
              f"  mma {r['mma']:>3}  {r['compile_s']:>5.1f} s  {'; '.join(r['problems'])}")
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
