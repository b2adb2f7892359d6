"""TFLOP/s and MFU of a training step (genome_lm.train.throughput)."""

import pytest

from genome_lm.config import load_config
from genome_lm.engine.devices import SPECS, device_peak_flops, measured_matmul_flops
from genome_lm.model import flops
from genome_lm.plan.memory_model import model_config
from genome_lm.train.throughput import Throughput


def test_a_rank_counts_its_share_of_its_micro_batches():
    run = load_config("demo-cpu")
    cfg = model_config(run)
    one = Throughput(run, cfg, micro_batches=1, ranks=1, gpu=False, peak=("test", 1e12))
    four = Throughput(run, cfg, micro_batches=4, ranks=2, gpu=False, peak=("test", 1e12))
    per_micro = flops.model_flops(cfg, run.memory, T=4096, indexer_loss_mode="sparse")
    assert one.flops(4096, "sparse") == pytest.approx(per_micro)
    assert four.flops(4096, "sparse") == pytest.approx(2 * per_micro)
    tflops, mfu = four.metrics(4096, "sparse", 2.0)
    assert tflops == pytest.approx(per_micro / 1e12) and mfu == pytest.approx(per_micro / 1e12)
    assert one.flops(4096, "dense") > one.flops(4096, "sparse")  # the dense indexer loss does more
    assert one.metrics(4096, "sparse", 0.0) == (0.0, 0.0)
    # recompute replays are not model FLOPs
    full = Throughput(load_config("demo-cpu", ["memory.recompute=full"]), cfg, micro_batches=1, ranks=1, gpu=False,
                      peak=("test", 1e12))
    assert full.flops(4096, "sparse") == pytest.approx(one.flops(4096, "sparse"))


def test_peaks():
    assert 1e8 < measured_matmul_flops(n=256, repeats=2) < 1e14
    label, peak = device_peak_flops("cpu")
    assert "CPU" in label and peak > 1e8
    assert SPECS["B200"].bf16_flops == 2.25e15 and SPECS["H100"].bf16_flops == 989e12
