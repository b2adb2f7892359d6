"""What a device can do: the GPU kinds genome-lm knows (their vendors' figures) and the peak a
step's MFU is measured against (``train.throughput``, ``plan.time_model``).

Every GPU figure is the vendor's public specification for the SXM part in its 8-GPU HGX/DGX
board (docs/plan.md, "The time model", lists the source of each); rates are per GPU and per
direction. On a CPU the peak is measured: the rate of a matrix product on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory: float  # usable HBM, bytes (decimal GB)
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s (without structured sparsity)
    hbm: float  # HBM bandwidth, bytes/s
    nvlink: float  # NVLink bandwidth per GPU and direction, bytes/s (inside a node)
    network: float  # inter-node bandwidth per GPU and direction (one NIC per GPU), bytes/s
    host_link: float  # PCIe to the host per GPU and direction, bytes/s
    host_memory: float  # host DRAM bandwidth per node (both sockets), bytes/s


SPECS: dict[str, GPUSpec] = {
    # DGX B200: 8 x B200, NVLink 5 (1.8 TB/s per GPU, both directions), 8 x ConnectX-7 400 Gb/s,
    # PCIe Gen5 x16, 2 x Xeon Platinum 8570 (8 channels of DDR5-5600 each)
    "B200": GPUSpec("B200", 180e9, 2.25e15, 8.0e12, 900e9, 50e9, 64e9, 2 * 8 * 5600e6 * 8),
    # DGX H200: 8 x H200, NVLink 4 (900 GB/s per GPU, both directions), 8 x ConnectX-7 400 Gb/s,
    # PCIe Gen5 x16, 2 x Xeon Platinum 8480C (8 channels of DDR5-4800 each)
    "H200": GPUSpec("H200", 141e9, 989e12, 4.8e12, 450e9, 50e9, 64e9, 2 * 8 * 4800e6 * 8),
    # DGX H100: as the H200 with 80 GB of HBM3 at 3.35 TB/s
    "H100": GPUSpec("H100", 80e9, 989e12, 3.35e12, 450e9, 50e9, 64e9, 2 * 8 * 4800e6 * 8),
}


def measured_matmul_flops(n: int = 1024, repeats: int = 5, dtype=None) -> float:
    """FLOP/s of an n x n x n matrix product on this machine's CPU (the best of ``repeats``, with
    torch's threads as set): the peak a CPU step's MFU is measured against."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: thread pool, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def spec_of(device_name: str) -> GPUSpec | None:
    """The ``SPECS`` entry a CUDA device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3") names."""
    return next((spec for key, spec in SPECS.items() if key in device_name.upper()), None)


def device_peak_flops(device: str = "cpu", dtype=None) -> tuple[str, float]:
    """(label, FLOP/s) that MFU is measured against: a GPU's dense bf16 tensor-core peak (from
    ``SPECS`` by its name; an unknown GPU gives 0, no MFU), or this CPU's measured matmul rate."""
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        spec = spec_of(name)
        return (f"{spec.name} bf16 dense peak", spec.bf16_flops) if spec else (f"{name} (unknown peak)", 0.0)
    return "this CPU's measured matmul rate", measured_matmul_flops(dtype=dtype)
