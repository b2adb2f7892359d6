"""The training/eval loader against an independent reading (megatron-core's IndexedDataset, the
manifest and the FASTA), plus its order, resume and sharding."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from genome_lm.data.loader import (
    IGNORE,
    SplitReader,
    TrainLoader,
    eval_batches,
    reverse_complement,
)
from genome_lm.data.manifest import Manifest
from genome_lm.data.prepare import PrepareRequest, prepare
from genome_lm.data.shards import unpack_softmask
from genome_lm.data.windows import WindowSpec
from genome_lm.engine import quiet_megatron_import
from genome_lm.errors import GenomeLMError
from tests.conftest import random_sequence, write_fasta

with quiet_megatron_import():
    from megatron.core.datasets.indexed_dataset import IndexedDataset

COMP = {0: 0, 1: 1, 2: 2, 3: 3, 4: 7, 5: 6, 6: 5, 7: 4, 8: 8}
SOFT_W = 0.25  # not the default, so a weight that ignores the setting shows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small prepared dataset: windows of 1000 with uneven tails, N runs, lowercase stretches,
    one window 80% N (kept by prepare, max_n_fraction=1, so the loader's own skipping is exercised)."""
    rng = np.random.default_rng(20261202)
    root = tmp_path_factory.mktemp("loader")
    chr1 = bytearray(random_sequence(rng, 5437))
    chr1[2100:2900] = b"N" * 800
    records = {"chr1": bytes(chr1), "chr2": random_sequence(rng, 3263), "chr22": random_sequence(rng, 2111)}
    fasta = write_fasta(root / "genome.fa", records)
    spec = WindowSpec(1000, 1000, "keep", min_tail=50, max_n_fraction=1.0)
    request = PrepareRequest(fasta, root / "ds", ("chr1", "chr2"), ("chr22",), spec)
    prepare(request, workers=1, quiet=True, cache_dir=root / "cache")
    return root / "ds", records


def independent(folder, split="train"):
    """Every window as (tokens list, soft-mask list), read with megatron-core's reader."""
    manifest = Manifest.load(folder)
    tokens = IndexedDataset(manifest.path_prefix(split))
    masks = IndexedDataset(manifest.softmask_prefix(split))
    windows = manifest.split(split).windows
    return [(np.array(tokens[i]).tolist(), unpack_softmask(np.array(masks[i]), w.length).tolist())
            for i, w in enumerate(windows)]


def expected_row(window_data, offset, reverse, seq_len, softmask_weight):
    """Tokens, labels and weights of a row, position by position, from the definition: a crop
    reads window offsets [lo, hi] (crops start at multiples of seq_len; hi is seq_len past lo or
    the window's end); its inputs are the first min(hi - lo + 1, seq_len) of them (from hi down
    when reversed), each labelled with the next one read."""
    toks, soft = window_data
    if reverse:  # offset is hi
        hi = offset
        lo = offset - seq_len if offset % seq_len == 0 else offset // seq_len * seq_len
    else:
        lo, hi = offset, min(offset + seq_len, len(toks) - 1)
    span = hi - lo + 1
    read = (lambda k: COMP[toks[hi - k]]) if reverse else (lambda k: toks[lo + k])
    is_soft = (lambda k: soft[hi - k]) if reverse else (lambda k: soft[lo + k])
    tokens, labels, weights = [], [], []
    for i in range(seq_len):
        tokens.append(read(i) if i < min(span, seq_len) else 0)
        if i + 1 < span:
            label = read(i + 1)
            labels.append(label)
            weights.append(0.0 if label == 8 else softmask_weight if is_soft(i + 1) else 1.0)
        else:
            labels.append(IGNORE)
            weights.append(0.0)
    return tokens, labels, weights


def rows(batch):
    for b in range(len(batch)):
        yield (int(batch.window[b]), int(batch.offset[b]), bool(batch.reverse[b]), batch.tokens[b].tolist(),
               batch.labels[b].tolist(), batch.loss_weight[b].tolist(), int(batch.length[b]))


def one_epoch(loader):
    """The rows of exactly one epoch (a single-rank loader at the start of an epoch)."""
    out = []
    while len(out) < loader.items_per_epoch:
        out += list(rows(loader.next_batch()))
    return out[: loader.items_per_epoch]


def test_reader_matches_megatron(dataset):
    folder, _ = dataset
    reader = SplitReader(folder, "train")
    data = independent(folder)
    rng = np.random.default_rng(0)
    assert len(reader) == len(data)
    for i, (toks, soft) in enumerate(data):
        assert reader.tokens(i).tolist() == toks
        assert reader.softmask(i).tolist() == soft
        for _ in range(5):  # ranges that start and stop inside a packed byte
            a = int(rng.integers(0, len(toks)))
            b = int(rng.integers(a, len(toks) + 3))
            assert reader.tokens(i, a, b).tolist() == toks[a:b]
            assert reader.softmask(i, a, b).tolist() == soft[a:b]


@pytest.mark.parametrize("seq_len,rc", [(256, 0.0), (333, 0.5), (1000, 1.0)])
def test_every_example_matches_an_independent_reading(dataset, seq_len, rc):
    folder, _ = dataset
    data = independent(folder)
    manifest = Manifest.load(folder)
    loader = TrainLoader(folder, "train", seq_len=seq_len, micro_batch_size=3, softmask_weight=SOFT_W,
                         reverse_complement=rc, seed=7)
    skipped = [i for i, (toks, _) in enumerate(data) if toks.count(8) / len(toks) > 0.5]
    assert len(skipped) == 1 and loader.skipped_windows == 1
    assert manifest.split("train").windows[skipped[0]].n_frac > 0.5

    epoch = one_epoch(loader)
    pairs = Counter()  # adjacent bases (p, p+1) of a window used as (input, label), either way
    for window, offset, reverse, tokens, labels, weights, length in epoch:
        exp_tokens, exp_labels, exp_weights = expected_row(data[window], offset, reverse, seq_len, SOFT_W)
        assert tokens == exp_tokens and labels == exp_labels, (window, offset, reverse)
        assert weights == pytest.approx(exp_weights), (window, offset, reverse)
        assert length == sum(1 for t in tokens if t != 0)
        step = -1 if reverse else 1
        for i, label in enumerate(labels):
            if label != IGNORE:
                here = offset + step * i
                pairs[(min(here, here + step), window)] += 1
    # Every adjacent pair of every kept window is trained on exactly once per epoch.
    kept = [w for w in range(len(data)) if w not in skipped]
    expected = Counter({(p, w): 1 for w in kept for p in range(len(data[w][0]) - 1)})
    assert pairs == expected
    if rc == 0.0:
        # ... and, forward only, every base but a window's first is a label exactly once.
        labelled = Counter((w, o + i + 1) for w, o, _, _, labels, _, _ in epoch
                           for i, lab in enumerate(labels) if lab != IGNORE)
        assert labelled == Counter({(w, p + 1): 1 for p, w in expected})
    reversed_share = np.mean([r[2] for r in epoch])
    assert reversed_share == rc if rc in (0.0, 1.0) else 0.2 < reversed_share < 0.8


def test_weights_at_n_and_softmasked_positions(dataset):
    """Label N -> 0, label soft-masked -> softmask_weight, other bases -> 1, no label -> 0."""
    folder, _ = dataset
    data = independent(folder)
    loader = TrainLoader(folder, "train", seq_len=400, micro_batch_size=4, max_n_fraction=1.0, shuffle=False)
    seen = Counter()
    for window, offset, _, tokens, labels, weights, length in one_epoch(loader):
        toks, soft = data[window]
        for i in range(400):
            p = offset + i + 1
            if i >= length or p >= len(toks):
                kind, want = "no label", 0.0
                assert labels[i] == IGNORE
            elif toks[p] == 8:
                kind, want = "N", 0.0
            elif soft[p]:
                kind, want = "soft", 0.1  # the default
            else:
                kind, want = "base", 1.0
            assert weights[i] == pytest.approx(want), (kind, window, p)
            seen[kind] += 1
    assert min(seen.values()) > 50, seen  # every case occurs


def test_reverse_complement_is_an_involution_and_weights_follow_the_bases(dataset):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 9, 1001).astype(np.uint8)
    soft = rng.random(1001) < 0.3
    rc_tokens, rc_soft = reverse_complement(tokens, soft)
    assert rc_tokens.tolist() == [COMP[t] for t in tokens[::-1].tolist()]
    assert rc_soft.tolist() == soft[::-1].tolist()
    back, back_soft = reverse_complement(rc_tokens, rc_soft)
    assert np.array_equal(back, tokens) and np.array_equal(back_soft, soft)

    # The same base gets the same weight whichever strand it is read on.
    folder, _ = dataset

    def weight_by_base(rc):
        loader = TrainLoader(folder, "train", seq_len=250, micro_batch_size=5, reverse_complement=rc, shuffle=False)
        out = {}
        for window, offset, reverse, _, labels, weights, _ in one_epoch(loader):
            assert reverse == bool(rc)
            for i, (label, weight) in enumerate(zip(labels, weights)):
                if label != IGNORE:
                    where = offset - i - 1 if reverse else offset + i + 1
                    out[(window, where)] = (COMP[label] if reverse else label, weight)
        return out

    forward, backward = weight_by_base(0.0), weight_by_base(1.0)
    common = forward.keys() & backward.keys()
    assert len(common) > 0.9 * len(forward)
    assert all(forward[k] == backward[k] for k in common)
    assert {w for _, w in forward.values()} == {0.0, np.float32(0.1), 1.0}


def test_reverse_complement_draws_are_seeded(dataset):
    folder, _ = dataset

    def flags(seed):
        loader = TrainLoader(folder, "train", seq_len=64, micro_batch_size=8, reverse_complement=0.5, seed=seed)
        return [r[2] for r in one_epoch(loader)]

    assert flags(3) == flags(3) != flags(4)
    assert 0.35 < np.mean(flags(3)) < 0.65


def _batches(loader, n):
    return [list(rows(loader.next_batch())) for _ in range(n)]


@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 1)])
def test_resume_sees_exactly_the_remaining_examples(dataset, world_size, rank):
    folder, _ = dataset
    kwargs = {"seq_len": 500, "micro_batch_size": 2, "reverse_complement": 0.5, "seed": 11,
              "rank": rank, "world_size": world_size}
    straight = TrainLoader(folder, "train", **kwargs)
    assert straight.items_per_epoch == 16  # 2 crops in each of 7 windows of 1000 (the N one skipped), 1 per tail
    first = _batches(straight, 7)
    state = json.loads(json.dumps(straight.state_dict()))  # as a checkpoint stores it
    rest = _batches(straight, 20)  # into the third epoch

    resumed = TrainLoader(folder, "train", **kwargs)
    resumed.load_state_dict(state)
    assert _batches(resumed, 20) == rest
    fresh = TrainLoader(folder, "train", **kwargs)
    assert _batches(fresh, 7) == first
    assert first != rest[:7]


def test_seq_len_change_is_resumable(dataset):
    folder, _ = dataset
    kwargs = {"seq_len": 500, "micro_batch_size": 3, "seed": 5}
    straight = TrainLoader(folder, "train", **kwargs)
    _batches(straight, 2)
    straight.set_seq_len(250)
    assert (straight.epoch, straight.position, straight.seq_len) == (1, 0, 250)
    _batches(straight, 3)
    state = straight.state_dict()
    rest = _batches(straight, 6)
    resumed = TrainLoader(folder, "train", **kwargs)
    resumed.load_state_dict(state)
    resumed.set_seq_len(250)  # what the trainer does each step: no change
    assert _batches(resumed, 6) == rest
    assert all(len(r[3]) == 250 for b in rest for r in b)


def test_rank_slices_are_disjoint_equal_and_cover_the_global_batch(dataset):
    folder, _ = dataset
    common = {"seq_len": 300, "reverse_complement": 0.5, "seed": 2}
    whole = TrainLoader(folder, "train", micro_batch_size=6, **common)
    ranks = [TrainLoader(folder, "train", micro_batch_size=2, rank=r, world_size=3, **common) for r in range(3)]
    seen = []
    for _ in range(12):  # past the end of the first epoch
        parts = [list(rows(loader.next_batch())) for loader in ranks]
        assert [len(p) for p in parts] == [2, 2, 2]
        assert [r for p in parts for r in p] == list(rows(whole.next_batch()))
        seen += [r[:3] for p in parts for r in p]
    first_epoch = seen[: whole.items_per_epoch]
    assert len(set(first_epoch)) == len(first_epoch)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_batches_cover_the_split_once_in_order(dataset, world_size):
    folder, _ = dataset
    data = independent(folder, "eval")
    got = []
    per_rank = [list(eval_batches(folder, "eval", seq_len=300, batch_size=2, rank=r, world_size=world_size))
                for r in range(world_size)]
    for step in range(max(len(p) for p in per_rank)):
        for p in per_rank:
            if step < len(p):
                got += list(rows(p[step]))
    assert [(w, o) for w, o, *_ in got] == [(w, s) for w, (t, _) in enumerate(data) for s in range(0, len(t) - 1, 300)]
    for window, offset, reverse, tokens, labels, weights, _ in got:
        assert (tokens, labels) == tuple(expected_row(data[window], offset, False, 300, 0.0)[:2])
        assert weights == pytest.approx(expected_row(data[window], offset, False, 300, 0.0)[2])


def test_window_and_offset_map_back_to_the_genome(dataset):
    folder, records = dataset
    manifest = Manifest.load(folder)
    code = {ord(c): t for c, t in zip("ACGTN", range(4, 9))}
    loader = TrainLoader(folder, "train", seq_len=128, micro_batch_size=8, reverse_complement=0.5, seed=3)
    for _ in range(5):
        batch = loader.next_batch()
        offsets = batch.token_offsets()
        assert batch.tokens.dtype == batch.labels.dtype == torch.int64 and batch.loss_weight.dtype == torch.float32
        assert batch.tokens.shape == batch.labels.shape == batch.loss_weight.shape == (8, 128)
        for b in range(8):
            for i in range(128):
                if offsets[b, i] < 0:
                    assert batch.tokens[b, i] == 0 and i >= batch.length[b]
                    continue
                chrom, pos = manifest.locate("train", int(batch.window[b]), int(offsets[b, i]))
                base = code.get(records[chrom][pos] & ~32, 8)  # IUPAC codes are N
                assert int(batch.tokens[b, i]) == (COMP[base] if batch.reverse[b] else base)


def test_errors_name_the_path(dataset, tmp_path):
    folder, _ = dataset
    with pytest.raises(GenomeLMError, match=str(tmp_path)):
        TrainLoader(tmp_path, "train", seq_len=100)
    with pytest.raises(GenomeLMError, match=rf"{folder}: no split 'valid'"):
        TrainLoader(folder, "valid", seq_len=100)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "train_softmask.idx").unlink()
    with pytest.raises(GenomeLMError, match=rf"{broken / 'train_softmask.idx'}: missing"):
        TrainLoader(broken, "train", seq_len=100)
    with open(broken / "eval.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(GenomeLMError, match=rf"{broken / 'eval.bin'}: 100 bytes, its index describes"):
        TrainLoader(broken, "eval", seq_len=100)
    with pytest.raises(GenomeLMError, match="seq_len 2000 is longer than the windows"):
        TrainLoader(folder, "train", seq_len=2000)
    state = TrainLoader(folder, "eval", seq_len=100).state_dict()
    with pytest.raises(GenomeLMError, match="data-loader state is for split='eval'"):
        TrainLoader(folder, "train", seq_len=100).load_state_dict(state)


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """A second prepared dataset to mix in: one record of another sequence, windows of 1000."""
    root = tmp_path_factory.mktemp("drill")
    fasta = write_fasta(root / "drill.fa", {"drill": random_sequence(np.random.default_rng(5), 4000)})
    prepare(PrepareRequest(fasta, root / "ds", ("drill",), (), WindowSpec(1000, 1000, "keep", min_tail=50)),
            workers=1, quiet=True, cache_dir=root / "cache")
    return root / "ds"


def test_a_mixed_split_joins_each_epoch_as_its_fraction(dataset, drill):
    """data.mix: every epoch still serves each item of the main split exactly once, plus
    f / (1 - f) as many items of the mixed split, distinct within the epoch, whose rows are that
    split's crops (checked against megatron-core's reading of it); a run without mixing is
    unchanged."""
    folder, _ = dataset
    kwargs = {"seq_len": 500, "micro_batch_size": 4, "seed": 4}  # 5 batches an epoch of 20
    plain = TrainLoader(folder, "train", **kwargs)
    mixed = TrainLoader(folder, "train", **kwargs, mix=[(drill, "train", 0.2)])
    n = plain.items_per_epoch  # 16
    assert mixed.items_per_epoch == n + round(0.2 / 0.8 * n) == 20
    drill_windows = independent(drill)
    seen_main, seen_drill, sources = Counter(), [], []
    for epoch in range(2):
        served = []
        while len(served) < mixed.items_per_epoch:
            batch = mixed.next_batch()
            served += list(zip(batch.source.tolist(), rows(batch)))
        main = [r[:3] for s, r in served if s == 0]
        drilled = [r for s, r in served if s == 1]
        assert sorted(main) == sorted(r[:3] for r in one_epoch(TrainLoader(folder, "train", **kwargs)))
        assert len(drilled) == 4 and len({r[:2] for r in drilled}) == 4  # without replacement
        for window, offset, reverse, tokens, *_ in drilled:
            want = drill_windows[window][0][offset: offset + 500]
            assert not reverse and tokens[: len(want)] == want
        seen_main.update(main)
        seen_drill.append({r[:2] for r in drilled})
        sources.append([s for s, _ in served])
    assert all(count == 2 for count in seen_main.values())  # once per epoch
    assert sources[0] != sources[1] and seen_drill[0] != seen_drill[1]  # reshuffled, other drill crops
    assert plain.next_batch().source is None  # without mixing the batches are as before


def test_a_mixed_loader_resumes_exactly_and_refuses_another_mix(dataset, drill):
    folder, _ = dataset
    kwargs = {"seq_len": 500, "micro_batch_size": 2, "reverse_complement": 0.5, "seed": 9,
              "mix": [(drill, "train", 0.3)]}
    straight = TrainLoader(folder, "train", **kwargs)
    _batches(straight, 9)
    state = json.loads(json.dumps(straight.state_dict()))
    rest = [(b.source.tolist(), list(rows(b))) for b in (straight.next_batch() for _ in range(15))]
    resumed = TrainLoader(folder, "train", **kwargs)
    resumed.load_state_dict(state)
    assert [(b.source.tolist(), list(rows(b))) for b in (resumed.next_batch() for _ in range(15))] == rest
    other = TrainLoader(folder, "train", **{**kwargs, "mix": [(drill, "train", 0.2)]})
    with pytest.raises(GenomeLMError, match="data-loader state is for mix="):
        other.load_state_dict(state)
    unmixed = TrainLoader(folder, "train", **{**kwargs, "mix": []})
    with pytest.raises(GenomeLMError, match="mixes nothing"):
        unmixed.load_state_dict(state)
    with pytest.raises(GenomeLMError, match="data.mix"):
        TrainLoader(folder, "train", **{**kwargs, "mix": [(drill, "train", 0.6), (drill, "train", 0.5)]})
