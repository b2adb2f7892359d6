"""Sizes and ranges of sizes as people write them (genome_lm.units)."""

from __future__ import annotations

import pytest

from genome_lm.units import parse_size, parse_size_range, parse_sizes


def test_sizes_take_binary_suffixes():
    assert [parse_size(t) for t in ("524288", "512k", "1M", "2kb")] == [524288, 524288, 1 << 20, 2048]
    assert parse_sizes("1k, 4k,") == [1024, 4096]


@pytest.mark.parametrize("text, expected", [("256-16k", (256, 16384)), ("1000-500000", (1000, 500000)),
                                            ("4k", (4096, 4096)), ("7-7", (7, 7))])
def test_a_range_is_two_sizes(text, expected):
    assert parse_size_range(text) == expected


@pytest.mark.parametrize("text, match", [("16k-256", "low end"), ("a-5", "not a size"), ("5-", "not a size"),
                                         ("0-5", "at least 1")])
def test_a_bad_range_says_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        parse_size_range(text)
