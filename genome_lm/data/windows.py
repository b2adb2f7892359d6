"""Where windows fall on a chromosome.

Windows start at 0, ``stride``, ``2*stride``... and are ``window`` bases long (non-overlapping
when ``stride == window``, the default). The *tail* is what remains after the last full window:
the bases from the next start to the chromosome's end. With ``tail="keep"`` it becomes one
shorter window if it holds at least ``min_tail`` bases; with ``tail="drop"`` (or when it is
shorter than ``min_tail``) it is dropped. A chromosome shorter than one window therefore
yields a single window of its full length under ``keep`` (if at least ``min_tail`` long) and
nothing under ``drop``. Dropped tails are recorded in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TailRule = Literal["keep", "drop"]

STUDY_WINDOW = 524_288  # the published run's window and sequence length: 512k bases
MAX_N_FRACTION = 0.5  # windows with more N than this are skipped (prepare, training and evaluation)


def too_many_n(n_fraction: float, max_n_fraction: float) -> bool:
    """The one rule for a mostly-N window: prepare skips it, the loader and evaluation leave it out."""
    return n_fraction > max_n_fraction


@dataclass(frozen=True)
class WindowSpec:
    window: int
    stride: int
    tail: TailRule = "keep"
    min_tail: int = 4096
    max_n_fraction: float = MAX_N_FRACTION

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if self.tail not in ("keep", "drop"):
            raise ValueError(f"tail must be 'keep' or 'drop', got {self.tail!r}")
        if self.min_tail < 1:
            raise ValueError(f"min_tail must be >= 1, got {self.min_tail}")
        if not 0.0 <= self.max_n_fraction <= 1.0:
            raise ValueError(f"max_n_fraction must be in [0, 1], got {self.max_n_fraction}")

    def as_json(self) -> dict:
        """The manifest's ``windows`` entry (schema genome-lm.dataset/1 names the threshold ``max_n_frac``)."""
        return {"window": self.window, "stride": self.stride, "tail": self.tail, "min_tail": self.min_tail,
                "max_n_frac": self.max_n_fraction}


def plan_windows(length: int, spec: WindowSpec) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """``(windows, dropped_tail)`` for a sequence of ``length`` bases; half-open intervals."""
    windows = [(start, start + spec.window) for start in range(0, length - spec.window + 1, spec.stride)]
    tail_start = windows[-1][0] + spec.stride if windows else 0
    if tail_start >= length:
        return windows, None
    if spec.tail == "keep" and length - tail_start >= spec.min_tail:
        windows.append((tail_start, length))
        return windows, None
    return windows, (tail_start, length)
