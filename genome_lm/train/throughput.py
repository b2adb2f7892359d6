"""TFLOP/s per GPU and MFU of each training step, as Megatron-LM and torchtitan log them.

A step's model FLOPs come from ``model.flops.model_flops`` (forward + backward of every micro-batch
this rank runs, recompute replays not counted: the FLOPs the model needs, not the ones the memory
switches add), divided over the ranks of one model replica (tensor x context x pipeline
parallel); MFU measures them against the device's peak: a known GPU's dense bf16 tensor-core
rate, or on a CPU this machine's measured matrix-product rate (``engine.devices``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from genome_lm.engine.devices import device_peak_flops

if TYPE_CHECKING:
    from genome_lm.config import RunConfig
    from genome_lm.model.config import ModelConfig


class Throughput:
    """The FLOP count of a run's steps and the peak they are measured against."""

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, *, micro_batches: int, ranks: int, gpu: bool,
                 peak: tuple[str, float] | None = None):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.micro_batches, self.ranks, self.gpu = micro_batches, ranks, gpu
        self.peak_label, self.peak = peak or device_peak_flops("cuda" if gpu else "cpu")
        self._cache: dict[tuple[int, str], float] = {}

    def flops(self, seq_len: int, mode: str) -> float:
        """Model FLOPs this rank runs in one step at ``seq_len`` with indexer-loss ``mode``."""
        key = (seq_len, mode)
        if key not in self._cache:
            from genome_lm.model.flops import model_flops

            per_micro = model_flops(self.model_cfg, self.cfg.memory, T=seq_len, batch=self.cfg.train.micro_batch_size,
                                    indexer_loss_mode=mode, gpu=self.gpu)
            self._cache[key] = per_micro * self.micro_batches / self.ranks
        return self._cache[key]

    def metrics(self, seq_len: int, mode: str, seconds: float) -> tuple[float, float]:
        """(TFLOP/s per GPU, MFU) of a step that took ``seconds``; MFU 0 without a known peak."""
        if seconds <= 0:
            return 0.0, 0.0
        rate = self.flops(seq_len, mode) / seconds
        return rate / 1e12, rate / self.peak if self.peak else 0.0
