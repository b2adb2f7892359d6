"""Counting how often the DSA indexer selects a copy's source (genome_lm.eval.probes.selection)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genome_lm.eval.probes.selection import source_selection, window_sources


def test_window_sources_maps_forward_copies_into_the_window():
    planted = [
        {"chrom": "c", "kind": "duplication", "src_start": 100, "src_end": 110, "dst_start": 150, "dst_end": 160},
        {"chrom": "c", "kind": "inversion", "src_start": 10, "src_end": 20, "dst_start": 170, "dst_end": 180},
        {"chrom": "c", "kind": "duplication", "src_start": 5, "src_end": 15, "dst_start": 95, "dst_end": 105},
        {"chrom": "d", "kind": "duplication", "src_start": 100, "src_end": 110, "dst_start": 150, "dst_end": 160},
    ]
    source = window_sources(90, 100, planted, "c")  # window [90, 190)
    expected = np.full(100, -1)
    expected[60:70] = np.arange(10, 20)  # 150..159 copied from 100..109 -> window 10..19
    # the third copy's source (5..14) lies before the window: not visible, -1
    assert np.array_equal(source, expected)


@pytest.fixture(scope="module")
def tiny_model():
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.model import build_model
    from genome_lm.model.presets import get_preset

    with parallel_context() as pg:
        torch.manual_seed(0)
        yield build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()


def test_a_window_within_topk_selects_every_source(tiny_model):
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 8, 200)  # fewer than index_topk (256) tokens: every key is selected
    source = np.where(rng.random(200) < 0.3, rng.integers(0, 200, 200), -1)
    source = np.where(source < np.arange(200), source, -1)
    counts = source_selection(tiny_model, tokens, source)
    assert [c.layer for c in counts] == [3]
    (c,) = counts
    assert c.copies == int((source[1:] >= 0).sum()) > 20
    assert c.hits == c.copies and c.chance == pytest.approx(1.0)


def test_a_source_in_the_querys_own_pool_is_always_selected(tiny_model):
    # past index_topk the indexer chooses, but the query's own incomplete pool is always kept
    rng = np.random.default_rng(1)
    L, kpool = 1500, tiny_model.cfg.index_kpool
    tokens = rng.integers(4, 8, L)
    j = np.arange(L)
    # query j - 1's incomplete tail pool: positions j - j % kpool .. j - 1 (none when j % kpool == 0)
    tail = j - j % kpool
    source = np.where((j > 600) & (j % kpool != 0), tail, -1)
    (c,) = source_selection(tiny_model, tokens, source)
    assert c.copies == int((source[1:] >= 0).sum()) and c.hits == c.copies
    far = np.where(j > 600, 0, -1)  # the first token, for queries that see > 600 tokens
    (d,) = source_selection(tiny_model, tokens, far)
    assert d.copies == L - 601 and 0 <= d.hits < d.copies
    # selected per query: 64 complete pools of 4 and the tail pool's (j % kpool) tokens
    assert d.chance == pytest.approx(np.mean((256 + j[601:] % kpool) / j[601:]), rel=1e-6)


def test_split_selection_counts_the_visible_forward_copies_of_a_prepared_split(tmp_path, tiny_model):
    from genome_lm.data.demo_genome import CopyPlan, generate_demo_genome, write_demo_genome
    from genome_lm.data.loader import SplitReader
    from genome_lm.data.prepare import PrepareRequest, prepare
    from genome_lm.data.windows import WindowSpec
    from genome_lm.eval.probes.selection import describe, split_selection

    plan = CopyPlan(per_mbp=3000, length_bp=(20, 100), distance_bp=(64, 400), inversions=0.3)
    fasta = write_demo_genome(tmp_path / "g.fa", seed=1, scale=0.02, copies=plan)
    prepare(PrepareRequest(fasta, tmp_path / "ds", ("chr1",), ("chr22",), WindowSpec(1024, 1024, "keep", 256, 0.5)),
            workers=1, quiet=True, cache_dir=tmp_path / "cache")
    planted = [c.to_json() for c in generate_demo_genome(seed=1, scale=0.02, copies=plan).planted]
    reader = SplitReader(tmp_path / "ds", "eval")
    for length, all_visible in ((256, True), (None, False)):
        (c,) = split_selection(tiny_model, tmp_path / "ds", planted, chrom="chr22", max_windows=3, length=length)
        # independently: bases 1.. of each chosen window inside a forward copy whose source base is in the window
        chosen = np.linspace(0, len(reader.windows) - 1, 3).astype(int)
        expected = 0
        for w in chosen:
            start = reader.windows[w].start
            n = min(length or reader.windows[w].length, reader.windows[w].length)
            for p in planted:
                if p["chrom"] == "chr22" and p["kind"] == "duplication":
                    expected += sum(1 for b in range(p["dst_start"], p["dst_end"])
                                    if start + 1 <= b < start + n and b - p["distance"] >= start)
        assert c.copies == expected > 0
        assert (c.hits == c.copies) if all_visible else (0 <= c.hits <= c.copies)
        assert describe([c])[0].startswith("DSA layer 3: its indexer selected the source of")
