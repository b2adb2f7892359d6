"""``compare-tracks``: the per-group log-likelihood gain of one score run over another equals a
direct computation from the two tables; its block-bootstrap interval holds it; runs of other
bases or contexts are refused in one line."""

import numpy as np
import pytest
from typer.testing import CliRunner

from genome_lm.errors import GenomeLMError
from genome_lm.eval.track_compare import compare_tracks
from genome_lm.eval.tracks import SegmentTracks, Table


def _write(folder, chrom, positions, loglik, context, ref):
    folder.mkdir()
    table = Table(folder / "tracks.parquet", ("loglik", "entropy", "context"))
    n = len(positions)
    for lo in range(0, n, 700):  # a row group per "segment"
        part = slice(lo, lo + 700)
        table.add(chrom, SegmentTracks(positions[part], loglik[part], np.zeros(len(positions[part])),
                                       np.zeros((len(positions[part]), 4)), context[part]), ref[part])
    table.close()


def test_gain_by_group_against_a_direct_computation(tmp_path):
    rng = np.random.default_rng(2)
    n = 5000
    positions = np.arange(1, n + 1, dtype=np.int64)
    context = np.tile(np.arange(0, 2500, 1, dtype=np.int64), 2)
    ref = rng.choice(list(b"ACGTacgt"), n).astype(np.uint8).tobytes()
    masked = np.char.islower(np.array(list(ref.decode())))
    start = -rng.gamma(2.0, 0.6, n)
    tuned = start + 0.05 * masked + rng.normal(0, 0.2, n)  # better on repeats only
    start[[10, 20]] = np.nan  # N references
    _write(tmp_path / "tuned", "chrT", positions, tuned, context, ref)
    _write(tmp_path / "start", "chrT", positions, start, context, ref)
    rows = {r.name: r for r in compare_tracks(tmp_path / "tuned", tmp_path / "start", block=250, resamples=400)}
    diff = tuned.astype(np.float32).astype(np.float64) - start.astype(np.float32).astype(np.float64)
    ok = ~np.isnan(diff)
    for name, mask in (("all bases", ok), ("unmasked", ok & ~masked), ("soft-masked (repeats)", ok & masked),
                       ("context 0-1k", ok & (context < 1024)), ("context 2k-4k", ok & (context >= 2048))):
        r = rows[name]
        assert r.bases == mask.sum() and r.gain == pytest.approx(diff[mask].mean(), rel=1e-9)
        assert r.ci[0] < r.gain < r.ci[1] and r.better == pytest.approx((diff[mask] > 0).mean())
    assert rows["soft-masked (repeats)"].ci[0] > 0.02 and rows["unmasked"].ci[0] < 0 < rows["unmasked"].ci[1]

    from genome_lm.cli import app

    result = CliRunner().invoke(app, ["compare-tracks", str(tmp_path / "tuned"), str(tmp_path / "start"),
                                      "--block", "250", "--resamples", "100"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and f"{rows['all bases'].gain:+.4f}" in result.output, result.output

    _write(tmp_path / "other", "chrT", positions + 1, start, context, ref)
    with pytest.raises(GenomeLMError, match="not the same bases"):
        compare_tracks(tmp_path / "tuned", tmp_path / "other")
    _write(tmp_path / "cut", "chrT", positions, start, context // 2, ref)
    with pytest.raises(GenomeLMError, match="other contexts"):
        compare_tracks(tmp_path / "tuned", tmp_path / "cut")
