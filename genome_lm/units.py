"""Sizes in bases as people write them (``524288``, ``512k``, ``1M``) and comma-separated lists.

The one place that reads them: the command line, the configs' callers and the evaluation's bucket
edges all import from here. A bad size raises ``ValueError`` with a one-line message; the command
line turns it into a bad-parameter error naming the option.
"""

from __future__ import annotations

SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """``"524288"``, ``"512k"`` or ``"1M"`` -> bases (k = 1,024; M = 1,048,576; a trailing b is allowed)."""
    text = text.strip().lower().removesuffix("b")
    scale = SIZE_SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(number) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 524288, 512k or 1M") from None
    if value < 1:
        raise ValueError(f"{text!r}: a size must be at least 1")
    return value


def size_label(n: int) -> str:
    """``1048576`` -> ``"1M"``, ``4096`` -> ``"4k"``, ``300`` -> ``"300"``: the shortest exact form."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n % (1 << 10) == 0:
        return f"{n >> 10}k"
    return str(n)


def parse_sizes(text: str) -> list[int]:
    """``"1k,4k, 16k"`` -> ``[1024, 4096, 16384]`` (empty items are ignored)."""
    return [parse_size(x) for x in text.split(",") if x.strip()]


def parse_size_range(text: str) -> tuple[int, int]:
    """``"256-16k"`` -> ``(256, 16384)``; a single size is a range of one."""
    low, sep, high = text.partition("-")
    lo, hi = parse_size(low), parse_size(high) if sep else parse_size(low)
    if lo > hi:
        raise ValueError(f"{text!r}: the low end of a range must not exceed the high end")
    return lo, hi
