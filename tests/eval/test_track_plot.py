"""The tracks' picture (``genome_lm.eval.track_plot``, ``score --plot``, ``plot-tracks``): which bases
of a planted later copy had their first copy in context, against a base-by-base loop; the figure
written with the in- and out-of-context losses that the table gives; bad input one line."""

import json

import numpy as np
import pytest

from genome_lm.eval.track_plot import TrackView, copy_context


def _naive(view, planted):
    out = []
    for p, ctx in zip(view.positions.tolist(), view.context.tolist()):
        flag = -1
        for c in planted:
            if c["chrom"] == view.chrom and c["dst_start"] <= p < c["dst_end"]:
                k = p - c["dst_start"]
                src = c["src_end"] - 1 - k if c["kind"] == "inversion" else c["src_start"] + k
                flag = int(p - src <= ctx)
        out.append(flag)
    return np.array(out)


@pytest.mark.parametrize("seed", range(5))
def test_copy_context_against_a_loop(seed):
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(5000, 3000, replace=False)).astype(np.int64)
    context = rng.integers(0, 1500, positions.size)
    view = TrackView("chrT", positions, rng.random(positions.size), rng.random(positions.size), context,
                     np.zeros(positions.size, bool))
    planted = []
    for _ in range(6):
        length = int(rng.integers(20, 300))
        src = int(rng.integers(0, 3000))
        dst = src + length + int(rng.integers(1, 1500))
        planted.append({"chrom": rng.choice(["chrT", "chrU"]), "kind": rng.choice(["duplication", "inversion"]),
                        "src_start": src, "src_end": src + length, "dst_start": dst, "dst_end": dst + length})
    planted.sort(key=lambda c: c["dst_start"])
    keep = []  # no two copies overlap (as the demo genome plants them)
    for c in planted:
        if not keep or c["dst_start"] >= keep[-1]["dst_end"]:
            keep.append(c)
    assert np.array_equal(copy_context(view, keep), _naive(view, keep))


def test_score_plot_on_the_demo_genome(tmp_path):
    """``score --plot`` on a small demo genome's chr22 (its copies 2.4, 9.1 and 15.2 kbp after their
    source; windows of 8k with 4k of context): tracks.png is a PNG, and the printed mean losses of
    the copies with the first copy in context, out of it, and of the other bases are those of
    the table and the planted file computed base by base. ``plot-tracks`` draws another region;
    a region with no scored bases is one line, exit 1, no file."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from genome_lm.cli import app
    from genome_lm.data.demo_genome import planted_json_path, write_demo_genome

    fasta = write_demo_genome(tmp_path / "demo.fa", scale=0.02)
    out = tmp_path / "tracks"
    result = CliRunner().invoke(app, ["score", "--model", "builtin:tiny-long", "--fasta", str(fasta), "--regions",
                                      "chr22", "--window", "8k", "--context", "4k", "--chunk", "4k", "--plot",
                                      "--quiet", "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert (out / "tracks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = pq.read_table(out / "tracks.parquet").to_pandas()
    view = TrackView("chr22", table.pos.to_numpy() - 1, -table.loglik.to_numpy(np.float64),
                     table.entropy.to_numpy(np.float64), table.context.to_numpy(), np.zeros(len(table), bool))
    flags = _naive(view, json.loads(planted_json_path(fasta).read_text())["planted"])
    assert (flags == 1).any() and (flags == 0).any()
    for name, flag in (("in context", 1), ("out of context", 0), ("other bases", -1)):
        loss = view.loss[(flags == flag) & ~np.isnan(view.loss)]
        assert f"{name}: {loss.mean():.4f} nats/base over {loss.size:,} bases" in result.output, result.output

    png = tmp_path / "part.png"
    result = CliRunner().invoke(app, ["plot-tracks", str(out), "--region", "chr22:20001-30000", "--out", str(png),
                                      "--smooth", "11"])
    assert result.exit_code == 0 and png.is_file(), result.output
    result = CliRunner().invoke(app, ["plot-tracks", str(out), "--region", "chr1:1-100", "--out",
                                      str(tmp_path / "none.png")])
    assert result.exit_code == 1 and "no scored bases in chr1:1-100" in result.output
    assert not (tmp_path / "none.png").exists()
