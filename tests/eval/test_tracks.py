"""Per-base tracks (``genome_lm.eval.tracks``): every base of a region once, in order, with at least
the stated context; the log-likelihood track is eval's per-token score of the same window; chunked
prefill gives the same tracks; the bigWig reads back as computed."""

import numpy as np
import pytest
import torch

from genome_lm.data.tokenizer import BASE_TOKENS, N
from genome_lm.engine.parallel import parallel_context
from genome_lm.errors import GenomeLMError
from genome_lm.eval.score import token_nll
from genome_lm.eval.tracks import BigWigs, Segment, score_segment, segments


@pytest.mark.parametrize("seed", range(20))
def test_segments_score_every_base_once_with_the_stated_context(seed):
    rng = np.random.default_rng(seed)
    window = int(rng.integers(3, 400))
    context = int(rng.integers(1, window))
    start = int(rng.integers(0, 1000))
    end = start + int(rng.integers(1, 3000))
    segs = segments(start, end, window=window, context=context)
    scored = np.concatenate([np.arange(s.start, s.end) for s in segs])
    assert np.array_equal(scored, np.arange(start, end))  # once each, in order
    for s in segs:
        assert s.end - s.window_start <= window
        assert s.start - s.window_start == min(context, s.start)  # the stated context, or the record's start


def test_bad_tilings_are_one_line():
    with pytest.raises(GenomeLMError, match="shorter than the window"):
        segments(0, 10, window=8, context=8)
    with pytest.raises(GenomeLMError, match="at least 1"):
        segments(0, 10, window=8, context=0)
    with pytest.raises(GenomeLMError, match="empty or negative region"):
        segments(5, 5, window=8, context=2)


def _record(length=700, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.choice(np.array(BASE_TOKENS), size=length).astype(np.uint8)
    tokens[[5, 333, 334]] = N
    return tokens


def test_loglik_is_evals_score_of_the_same_window(model):
    """Uneven segments (window 300, context 120, a region not on any boundary): the log-likelihood
    of each scored base is minus eval's NLL of the same window's target (1e-6); the entropy and
    the A/C/G/T probabilities agree with a plain softmax; N references are NaN."""
    tokens = _record()
    got = [score_segment(model, tokens, s) for s in segments(3, 651, window=300, context=120)]
    for seg, part in zip(segments(3, 651, window=300, context=120), got):
        nll = token_nll(model, tokens[seg.window_start:seg.end])
        want = -nll[part.positions - seg.window_start - 1]
        ref = tokens[part.positions]
        assert np.isnan(part.loglik[ref == N]).all()
        np.testing.assert_allclose(part.loglik[ref != N], want[ref != N], rtol=1e-6, atol=1e-7)
        assert np.all(part.context == part.positions - seg.window_start)
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens[seg.window_start:seg.end - 1].astype(np.int64))[None]).logits[0]
        p = torch.softmax(logits.double(), -1)[part.positions - seg.window_start - 1]
        np.testing.assert_allclose(part.probs, p[:, list(BASE_TOKENS)].numpy(), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(part.entropy, -(p * p.log()).sum(-1).numpy(), rtol=1e-6)
    positions = np.concatenate([p.positions for p in got])
    assert np.array_equal(positions, np.arange(3, 651))


def test_chunked_prefill_gives_the_same_tracks(model):
    tokens = _record(seed=1)
    seg = Segment(0, 0, 650)  # the record's start: its first base is not scored
    whole = score_segment(model, tokens, seg)
    assert whole.positions[0] == 1
    for chunk in (64, 100):
        part = score_segment(model, tokens, seg, chunk=chunk)
        for name in ("loglik", "entropy", "probs"):
            np.testing.assert_allclose(getattr(part, name), getattr(whole, name), rtol=1e-5, atol=1e-7)


def test_bigwig_reads_back_as_computed(model, tmp_path):
    pyBigWig = pytest.importorskip("pyBigWig")
    tokens = _record(seed=2)
    segs = segments(0, 700, window=256, context=64)
    parts = [("chrT", score_segment(model, tokens, s)) for s in segs]
    files = {"loglik": "loglik.bw", "p_g": "p_g.bw", "context": "context.bw"}
    bigwigs = BigWigs({t: tmp_path / f for t, f in files.items()}, {"chrT": 700, "chrU": 50})
    for chrom, seg in parts:
        bigwigs.add(chrom, seg)
    bigwigs.close()
    for track, file in files.items():
        bw = pyBigWig.open(str(tmp_path / file))
        assert bw.chroms() == {"chrT": 700, "chrU": 50}
        got = np.array(bw.values("chrT", 0, 700))
        want = np.full(700, np.nan)
        for _, seg in parts:
            want[seg.positions] = seg.track(track)
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-7, equal_nan=True)
        bw.close()


def test_score_command_writes_tracks_a_reader_gets_back(tmp_path):
    """``genome-lm score`` on two regions of a small genome (one at a record's start): every base
    once, in genomic order, the table's log-likelihood that of scoring the same segments directly,
    the bigWig equal to the table; bad input one line, exit 1, nothing left behind."""
    import pyarrow.parquet as pq
    import pyBigWig
    from typer.testing import CliRunner

    from genome_lm.cli import app
    from genome_lm.data.tokenizer import tokenize
    from genome_lm.eval.models import load_model
    from tests.conftest import random_sequence, write_fasta

    rng = np.random.default_rng(4)
    records = {"chrA": random_sequence(rng, 1500), "chrB": random_sequence(rng, 900)}
    fasta = write_fasta(tmp_path / "g.fa", records)
    out = tmp_path / "tracks"
    args = ["score", "--model", "builtin:tiny-long", "--fasta", str(fasta), "--regions", "chrB:101-900,chrA",
            "--window", "400", "--context", "150", "--chunk", "128", "--quiet"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "scored 2,299 bases of chrA:1-1,500, chrB:101-900\n" in result.output
    assert all(len(line) <= 80 for line in result.output.splitlines() if str(tmp_path) not in line), result.output
    table = pq.read_table(out / "tracks.parquet").to_pandas()
    # genomic order (the FASTA's record order), each base once: chrA from its second base, chrB 101-900
    assert list(table.chrom.unique()) == ["chrA", "chrB"]
    assert table[table.chrom == "chrA"].pos.tolist() == list(range(2, 1501))
    assert table[table.chrom == "chrB"].pos.tolist() == list(range(101, 901))
    assert "".join(table[table.chrom == "chrB"].ref).encode() == records["chrB"][100:900]
    assert table.context.min() >= 1 and table[table.pos > 150].context.min() >= 150
    with parallel_context() as pg:
        model = load_model("builtin:tiny-long", pg).model.eval()
        tokens = tokenize(records["chrB"])
        want = np.concatenate([score_segment(model, tokens, s).loglik
                               for s in segments(100, 900, window=400, context=150)])
    got = table[table.chrom == "chrB"].loglik.to_numpy()
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, equal_nan=True)
    bw = pyBigWig.open(str(out / "loglik.bw"))
    assert bw.chroms() == {"chrA": 1500, "chrB": 900}
    np.testing.assert_allclose(np.array(bw.values("chrB", 100, 900)), got, rtol=1e-7, equal_nan=True)
    bw.close()

    for more, message in ((["--regions", "chrB:800-1,000"], "reaches past the end of chrB"),
                          (["--regions", "chrZ"], "no record 'chrZ'"),
                          (["--regions", "chrA:1-100,chrA:50-200"], "overlap"),
                          (["--context", "400"], "shorter than the window")):
        bad = tmp_path / "bad"
        result = CliRunner().invoke(app, [*args, *more, "--out", str(bad)])
        assert result.exit_code == 1 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert not bad.exists() and not (tmp_path / "bad.partial").exists()
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 1 and "exists and is not empty" in result.output


def test_score_takes_bed_intervals_and_names_a_bad_line(tmp_path):
    """BED intervals (0-based, end exclusive) scored as regions, in the FASTA's order whatever the
    file's; a malformed line is one error naming the file and the line."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from genome_lm.cli import app
    from tests.conftest import random_sequence, write_fasta

    rng = np.random.default_rng(5)
    fasta = write_fasta(tmp_path / "g.fa", {"chrA": random_sequence(rng, 600), "chrB": random_sequence(rng, 600)})
    bed = tmp_path / "r.bed"
    bed.write_text("track name=x\n# a comment\nchrB\t10\t40\tpeak1\nchrA\t100\t130\n\nchrA\t300\t302\n")
    args = ["score", "--model", "builtin:tiny-long", "--fasta", str(fasta), "--window", "200", "--context", "50",
            "--quiet"]
    result = CliRunner().invoke(app, [*args, "--bed", str(bed), "--out", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "t" / "tracks.parquet").to_pandas()
    assert list(zip(table.chrom, table.pos)) == ([("chrA", p) for p in range(101, 131)] + [("chrA", 301), ("chrA", 302)]
                                                 + [("chrB", p) for p in range(11, 41)])
    for text, message in (("chrA\t5\n", "r.bed:1: a BED line needs chrom, start and end"),
                          ("chrA\t1\t5\nchrA\tx\t9\n", "r.bed:2: start and end must be whole numbers"),
                          ("chrA\t9\t9\n", "r.bed:1: an interval needs 0 <= start < end"),
                          ("# nothing\n", "r.bed: no intervals")):
        bed.write_text(text)
        result = CliRunner().invoke(app, [*args, "--bed", str(bed), "--out", str(tmp_path / "bad")])
        assert result.exit_code == 1 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
        assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()


def test_an_interrupted_score_rerun_gives_the_unbroken_runs_files(tmp_path, monkeypatch):
    """Stopped after two segments (as by Ctrl-C), the folder keeps them; the same command again
    scores only the rest, and its files are byte for byte those of a run that was never stopped.
    Other settings on the interrupted folder are refused in one line."""
    from genome_lm.eval import tracks
    from tests.conftest import random_sequence, write_fasta

    rng = np.random.default_rng(6)
    fasta = write_fasta(tmp_path / "g.fa", {"chrA": random_sequence(rng, 1000)})

    def request(out, **more):
        return tracks.ScoreRequest(model="builtin:tiny-long", fasta=fasta, regions=("chrA",), out=out, window=300,
                                   context=100, **more)

    tracks.score_fasta(request(tmp_path / "unbroken"), progress=False)
    real, calls = tracks.score_segment, []

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tracks, "score_segment", stopping)
    with pytest.raises(KeyboardInterrupt):
        tracks.score_fasta(request(tmp_path / "cut"), progress=False)
    kept = sorted(p.name for p in (tmp_path / "cut.partial" / "parts").iterdir())
    assert kept == ["00000-0000000.npz", "00000-0000001.npz"] and not (tmp_path / "cut").exists()
    with pytest.raises(GenomeLMError, match="an interrupted score with other settings \\(context differ\\)") as err:
        tracks.score_fasta(tracks.ScoreRequest(model="builtin:tiny-long", fasta=fasta, regions=("chrA",),
                                               out=tmp_path / "cut", window=300, context=120), progress=False)
    assert "\n" not in str(err.value)
    calls.clear()
    monkeypatch.setattr(tracks, "score_segment", lambda *a, **k: calls.append(1) or real(*a, **k))
    tracks.score_fasta(request(tmp_path / "cut"), progress=False)
    assert len(calls) == len(tracks.segments(0, 1000, window=300, context=100)) - 2  # only the missing ones
    assert not (tmp_path / "cut.partial").exists()
    names = sorted(p.name for p in (tmp_path / "unbroken").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cut").iterdir())
    for name in names:
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "unbroken" / name).read_bytes(), name


def test_every_scored_base_gets_finite_tracks(model):
    """No position is left unfilled (the arrays start as NaN): with chunks that do not divide the
    window, every base's entropy and probabilities are finite, and its log-likelihood too unless
    the reference is N."""
    tokens = _record(seed=3)
    for chunk in (None, 37, 128):
        for seg in segments(0, 700, window=290, context=91):
            part = score_segment(model, tokens, seg, chunk=chunk)
            assert np.isfinite(part.entropy).all() and np.isfinite(part.probs).all()
            assert np.isfinite(part.loglik[tokens[part.positions] != N]).all()
