"""Embeddings (``genome_lm.eval.embeddings``, ``genome-lm score --embeddings``): every base's row
equals a full forward's hidden state of the same layer and window, whole or in prefill chunks;
pooled rows are the mean of their bases; an interrupted run continues to the unbroken run's
bytes; bad layers and bins are one line with nothing left behind."""

import numpy as np
import pytest
import torch

from genome_lm.data.regions import Region
from genome_lm.engine.parallel import parallel_context
from genome_lm.errors import GenomeLMError
from genome_lm.eval.embeddings import (
    EmbeddingSpec,
    EmbeddingStore,
    LayerTaps,
    chunk_rows,
    parse_layers,
    parse_pool,
    read_embeddings,
)
from genome_lm.eval.tracks import score_segment, segments
from tests.eval.test_tracks import _record


@torch.no_grad()
def reference(model, ids: np.ndarray, layer: str) -> np.ndarray:
    """[L, D]: the model's own forward (no hooks) over ``ids``: ``final`` is ``hidden()``'s
    output; layer i is the mean of the streams of the model cut after layer i."""
    x = torch.from_numpy(ids.astype(np.int64))[None]
    if layer == "final":
        return model.hidden(x)[0][:, 0].numpy()
    keep, post = model.layers, model.post_process
    try:
        model.layers, model.post_process = keep[:int(layer.split("_")[1]) + 1], False
        streams, _ = model.hidden(x)
    finally:
        model.layers, model.post_process = keep, post
    return streams.mean(dim=2)[:, 0].numpy()


def _store_and_score(model, tokens, region: Region, spec: EmbeddingSpec, tmp, *, window=300, context=120,
                     chunk=None):
    store = EmbeddingStore(tmp / "e.zarr", [region], spec, model.cfg.hidden_size, window - context)
    with LayerTaps(model, spec.layers) as taps:
        for seg in segments(region.start, region.end, window=window, context=context):
            score_segment(model, tokens, seg, chunk=chunk, taps=taps, rows=store.segment(0, seg.start))
    return store


@pytest.mark.parametrize("chunk", [None, 77])
def test_every_bases_row_is_the_full_forwards_hidden_state(model, tmp_path, chunk):
    """Uneven segments (window 300, context 120, regions on no boundary, one at the record's start),
    whole windows and prefill chunks that do not divide them: each base's row equals the hidden
    state of a full forward over the segment's window at that base (1e-5 of the largest), for a
    first, a middle and the final layer; every row is written (no NaN left)."""
    tokens = _record()
    layers = ("layer_0", "layer_2", "final")
    for k, region in enumerate((Region("chrT", 0, 650), Region("chrT", 13, 700))):
        spec = EmbeddingSpec(layers, 1, "float32")
        _store_and_score(model, tokens, region, spec, tmp_path / str(k), chunk=chunk)
        for layer in layers:
            (attrs, starts, got), = read_embeddings(tmp_path / str(k) / "e.zarr", layer)
            assert (attrs["start"], attrs["end"]) == (region.start, region.end)
            assert np.array_equal(starts, np.arange(region.start, region.end))
            assert got.shape == (region.end - region.start, model.cfg.hidden_size) and np.isfinite(got).all()
            for seg in segments(region.start, region.end, window=300, context=120):
                want = reference(model, tokens[seg.window_start:seg.end], layer)[seg.start - seg.window_start:]
                rows = got[seg.start - region.start:seg.end - region.start]
                np.testing.assert_allclose(rows, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_tracks_are_unchanged_by_embeddings(model, tmp_path):
    """Feeding the window's last base (for its embedding) leaves the tracks as they were (1e-6)."""
    tokens = _record(seed=2)
    store = EmbeddingStore(tmp_path / "e.zarr", [Region("chrT", 0, 700)], EmbeddingSpec(("final",)), 64, 180)
    with LayerTaps(model, ("final",)) as taps:
        for seg in segments(0, 700, window=300, context=120):
            plain = score_segment(model, tokens, seg, chunk=64)
            tapped = score_segment(model, tokens, seg, chunk=64, taps=taps, rows=store.segment(0, seg.start))
            for name in ("loglik", "entropy", "probs"):
                np.testing.assert_allclose(getattr(tapped, name), getattr(plain, name), rtol=1e-6, atol=1e-9)
            assert np.array_equal(tapped.positions, plain.positions)


def test_pooled_rows_are_the_mean_of_their_bases(model, tmp_path):
    """mean:60 (dividing the 180 bases a window adds): each row the mean of its bases' per-base
    rows, the region's last row of the 10 bases left over; float16 within its rounding."""
    tokens = _record(seed=3)
    region = Region("chrT", 10, 700)  # 690 bases: 11 bins of 60 and one of 30
    _store_and_score(model, tokens, region, EmbeddingSpec(("layer_1",), 1, "float32"), tmp_path / "base")
    _store_and_score(model, tokens, region, EmbeddingSpec(("layer_1",), 60, "float32"), tmp_path / "pool")
    _store_and_score(model, tokens, region, EmbeddingSpec(("layer_1",), 60, "float16"), tmp_path / "half")
    (_, _, per_base), = read_embeddings(tmp_path / "base" / "e.zarr", "layer_1")
    (_, starts, pooled), = read_embeddings(tmp_path / "pool" / "e.zarr", "layer_1")
    (_, _, half), = read_embeddings(tmp_path / "half" / "e.zarr", "layer_1")
    assert np.array_equal(starts, 10 + 60 * np.arange(12)) and pooled.shape == (12, 64)
    want = np.stack([per_base[i:i + 60].mean(0) for i in range(0, 690, 60)])
    np.testing.assert_allclose(pooled, want, rtol=1e-5, atol=1e-6)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half.astype(np.float32), want, rtol=2e-3, atol=1e-3)


def test_layer_names_and_bins():
    assert parse_layers("", 4) == ("final",) and parse_layers("final,-1,0,3", 4) == ("final", "layer_3", "layer_0")
    for bad, said in (("4", "layer 4 does not exist"), ("-5", "layer -5 does not exist"), ("mlp", "'mlp' is not")):
        with pytest.raises(GenomeLMError, match=said):
            parse_layers(bad, 4)
    assert parse_pool(None) == 1 and parse_pool("none") == 1 and parse_pool("mean:128") == 128
    for bad in ("max:4", "mean:0", "mean:x", "mean"):
        with pytest.raises(GenomeLMError, match="expected 'none' or 'mean:N'"):
            parse_pool(bad)
    for rows, pool, width in ((24576, 1, 64), (7, 1, 1 << 20), (1000003, 1, 6144), (192, 128, 6144), (180, 60, 64)):
        c = chunk_rows(rows, pool, width)
        assert rows % c == 0 and (c == 1 or c * pool * width * 4 <= 16 << 20)
    assert chunk_rows(24576, 1, 64) == 24576 and chunk_rows(1 << 20, 1, 6144) == 512


def test_score_embeddings_resume_to_the_unbroken_bytes_and_refuse_bad_input(tmp_path, monkeypatch):
    """``genome-lm score --embeddings``: killed after two segments and run again, the store and
    the tracks are byte for byte an unbroken run's; its per-base rows of a segment equal the
    builtin model's full forward; a layer that does not exist or a bin that straddles windows is
    one line, exit 1, nothing left behind."""
    from typer.testing import CliRunner

    from genome_lm.cli import app
    from genome_lm.data.tokenizer import tokenize
    from genome_lm.eval import tracks
    from genome_lm.eval.models import load_model
    from tests.conftest import random_sequence, write_fasta

    rng = np.random.default_rng(9)
    seq = random_sequence(rng, 1000)
    fasta = write_fasta(tmp_path / "g.fa", {"chrA": seq})

    def request(out, **more):
        return tracks.ScoreRequest(model="builtin:tiny-long", fasta=fasta, regions=("chrA:101-1000",), out=out,
                                   window=300, context=100, chunk=128, embeddings="1,final", **more)

    tracks.score_fasta(request(tmp_path / "unbroken"), progress=False)
    real, calls = tracks.score_segment, []

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            rows = kwargs["rows"]  # a segment cut short: part of its chunk written
            rows.group["final"][rows.row:rows.row + 5] = np.zeros((5, 64), np.float16)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tracks, "score_segment", stopping)
    with pytest.raises(KeyboardInterrupt):
        tracks.score_fasta(request(tmp_path / "cut"), progress=False)
    monkeypatch.setattr(tracks, "score_segment", real)
    tracks.score_fasta(request(tmp_path / "cut"), progress=False)
    files = sorted(p.relative_to(tmp_path / "unbroken") for p in (tmp_path / "unbroken").rglob("*") if p.is_file())
    assert "embeddings.zarr/0/final/c/0/0" in {str(f) for f in files}
    assert files == sorted(p.relative_to(tmp_path / "cut") for p in (tmp_path / "cut").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "cut" / f).read_bytes() == (tmp_path / "unbroken" / f).read_bytes(), f

    (_, starts, got), = read_embeddings(tmp_path / "unbroken" / "embeddings.zarr", "final")
    assert np.array_equal(starts, np.arange(100, 1000)) and got.dtype == np.float16
    with parallel_context() as pg:
        loaded = load_model("builtin:tiny-long", pg)
        tokens = tokenize(seq)
        seg = segments(100, 1000, window=300, context=100)[1]
        want = reference(loaded.model.eval(), tokens[seg.window_start:seg.end], "final")[100:]
    np.testing.assert_allclose(got[seg.start - 100:seg.end - 100].astype(np.float32), want, rtol=2e-3, atol=2e-3)

    base = ["score", "--model", "builtin:tiny-long", "--fasta", str(fasta), "--regions", "chrA", "--window", "300",
            "--context", "100", "--quiet"]
    for more, said in ((["--embeddings", "7"], "layer 7 does not exist (the model has 4 layers"),
                       (["--embeddings", "final", "--pool", "mean:7"], "--pool mean:7: the bin must divide"),
                       (["--pool", "mean:4"], "--pool shapes the embeddings: give --embeddings"),
                       (["--embeddings", "0", "--embedding-dtype", "int8"], "expected float16 or float32")):
        out = tmp_path / f"bad-{len(more)}-{more[-1]}"
        result = CliRunner().invoke(app, [*base, *more, "--out", str(out)])
        assert result.exit_code == 1 and said in result.output, result.output
        assert not out.exists() and not out.with_name(out.name + ".partial").exists()
