import pytest

from genome_lm.data.windows import WindowSpec, plan_windows


def brute_force(length, spec):
    """Walk base by base: a window starts every `stride`; the rest is the tail."""
    windows, start = [], 0
    while start + spec.window <= length:
        windows.append((start, start + spec.window))
        start += spec.stride
    tail = (start, length) if start < length else None
    if tail and spec.tail == "keep" and length - start >= spec.min_tail:
        return windows + [tail], None
    return windows, tail


@pytest.mark.parametrize("tail", ["keep", "drop"])
def test_matches_brute_force(rng, tail):
    for _ in range(300):
        window = int(rng.integers(1, 50))
        spec = WindowSpec(window, int(rng.integers(1, 60)), tail, int(rng.integers(1, 30)))
        length = int(rng.integers(0, 400))
        assert plan_windows(length, spec) == brute_force(length, spec)


def test_study_defaults_tile_without_overlap():
    spec = WindowSpec(524_288, 524_288, "keep", 4096)
    windows, tail = plan_windows(50_818_468, spec)  # hg38 chr22
    assert len(windows) == 97 and tail is None
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    assert windows[-1] == (96 * 524_288, 50_818_468)


def test_short_tail_is_dropped_and_reported():
    windows, tail = plan_windows(10_100, WindowSpec(1000, 1000, "keep", 200))
    assert windows[-1] == (9000, 10_000) and tail == (10_000, 10_100)


@pytest.mark.parametrize(
    "kwargs", [dict(window=0, stride=1), dict(window=1, stride=0), dict(window=1, stride=1, tail="pad")]
)
def test_rejects_bad_specs(kwargs):
    with pytest.raises(ValueError):
        WindowSpec(**kwargs)
