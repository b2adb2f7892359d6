"""`genome-lm prepare` end to end, checked against independent readers (pyfaidx, megatron-core)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyfaidx
import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.data.manifest import Manifest
from genome_lm.data.prepare import PrepareRequest, prepare
from genome_lm.data.shards import unpack_softmask
from genome_lm.data.windows import WindowSpec, plan_windows
from genome_lm.engine import quiet_megatron_import
from tests.conftest import random_sequence, shared_genome, write_fasta
from tests.data.test_tokenizer import naive_tokenize

with quiet_megatron_import():
    from megatron.core.datasets.indexed_dataset import IndexedDataset


def read_split(manifest: Manifest, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every window of a split as (tokens, soft-mask), read back with megatron-core's own reader."""
    tokens = IndexedDataset(manifest.path_prefix(split))
    masks = IndexedDataset(manifest.softmask_prefix(split))
    windows = manifest.split(split).windows
    assert len(tokens) == len(masks) == len(windows)
    assert tokens.document_indices.tolist() == list(range(len(tokens) + 1))  # one document per window
    assert tokens.sequence_lengths.tolist() == [w.length for w in windows]
    # copies: the memory maps close with the datasets
    return [(np.array(tokens[i]), unpack_softmask(np.array(masks[i]), w.length)) for i, w in enumerate(windows)]


def plain_copy(path: Path, folder: Path) -> Path:
    """An uncompressed copy for pyfaidx, the independent reader."""
    out = folder / "independent.fa"
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rb") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


def check_against_pyfaidx(manifest: Manifest, fasta: Path, folder: Path, rng, n_check: int | None = None) -> None:
    reference = pyfaidx.Fasta(str(plain_copy(fasta, folder)), as_raw=True, sequence_always_upper=False)
    for split in manifest.data["splits"]:
        windows = manifest.split(split).windows
        data = read_split(manifest, split)
        picks = range(len(windows)) if n_check is None else rng.choice(len(windows), min(n_check, len(windows)),
                                                                       replace=False)
        for i in picks:
            w = windows[i]
            text = reference[w.chrom][w.start : w.end]
            ref_tokens, ref_flags = naive_tokenize(text)
            tokens, softmask = data[i]
            assert tokens.dtype == np.uint8 and tokens.tolist() == ref_tokens, (split, i)
            assert softmask.tolist() == [bool(f & 1) for f in ref_flags] == [c.islower() for c in text], (split, i)
            assert w.n_frac == pytest.approx(ref_tokens.count(8) / len(text), abs=1e-6)
            assert w.softmask_frac == pytest.approx(sum(c.islower() for c in text) / len(text), abs=1e-6)
            assert w.ambiguous_frac == pytest.approx(sum(f >= 2 for f in ref_flags) / len(text), abs=1e-6)


def random_genome(tmp_path, rng, compression="plain", names=("chr1", "chr2", "chr22", "chrM")) -> tuple[Path, dict]:
    records = {name: random_sequence(rng, int(rng.integers(3_000, 20_000))) for name in names}
    path = write_fasta(tmp_path / "in" / "genome.fa.gz", records, width=int(rng.integers(50, 81)),
                       compression=compression)
    return path, records


@pytest.mark.parametrize("compression", ["plain", "gzip", "bgzf"])
@pytest.mark.parametrize("window,stride,tail", [(1000, 1000, "keep"), (777, 500, "drop"), (4096, 4096, "keep")])
def test_tokens_match_an_independent_read(tmp_path, rng, compression, window, stride, tail):
    fasta, records = random_genome(tmp_path, rng, compression)
    spec = WindowSpec(window, stride, tail, min_tail=100, max_n_fraction=0.5)
    result = prepare(PrepareRequest(fasta, tmp_path / "out", ("1", "chr2"), ("NC_000022.11",), spec), workers=1,
                     quiet=True)
    manifest = result.manifest
    check_against_pyfaidx(manifest, fasta, tmp_path, rng)
    # Every planned window is either in the dataset or recorded as skipped, in order.
    for split, chroms in (("train", ["chr1", "chr2"]), ("eval", ["chr22"])):
        data = manifest.split(split).data
        seen = sorted((w["chrom"], w["start"], w["end"]) for w in data["windows"] + data["skipped"])
        planned = sorted((c, a, b) for c in chroms for a, b in plan_windows(len(records[c]), spec)[0])
        assert seen == planned
        assert data["n_tokens"] == sum(w["end"] - w["start"] for w in data["windows"])
    assert manifest.data["source"]["compression"] == compression


def test_mostly_n_windows_are_skipped_and_recorded(tmp_path, rng):
    seq = bytearray(random_sequence(rng, 10_000))
    seq[2000:2700] = b"N" * 700  # window [2000, 3000) is 70% N
    seq[5000:5300] = b"n" * 300  # window [5000, 6000) is 30% N: kept
    fasta = write_fasta(tmp_path / "g.fa", {"chr1": bytes(seq), "chr22": random_sequence(rng, 3000)})
    spec = WindowSpec(1000, 1000, "keep", 100, max_n_fraction=0.5)
    manifest = prepare(PrepareRequest(fasta, tmp_path / "out", ("chr1",), ("chr22",), spec), workers=1,
                       quiet=True).manifest
    skipped = [(w["start"], w["reason"]) for w in manifest.split("train").data["skipped"]]
    assert [s for s, _ in skipped if s == 2000] == [2000] and "N fraction" in skipped[0][1]
    assert (5000, 6000) in [(w.start, w.end) for w in manifest.split("train").windows]


def test_locate_maps_tokens_to_genome_positions(tmp_path, rng):
    fasta, records = random_genome(tmp_path, rng)
    spec = WindowSpec(1000, 600, "keep", 100, 1.0)
    manifest = prepare(PrepareRequest(fasta, tmp_path / "out", ("chr1",), (), spec), workers=1, quiet=True).manifest
    data = read_split(manifest, "train")
    for _ in range(200):
        doc = int(rng.integers(len(data)))
        offset = int(rng.integers(len(data[doc][0])))
        chrom, pos = manifest.locate("train", doc, offset)
        assert naive_tokenize(records[chrom][pos : pos + 1].decode())[0] == [data[doc][0][offset]]
    with pytest.raises(IndexError):
        manifest.locate("train", 0, 10_000)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_parallel_output_is_byte_identical_to_serial(tmp_path, rng):
    fasta, _ = random_genome(tmp_path, rng, "bgzf")
    spec = WindowSpec(1000, 1000, "keep", 100)
    request = dict(fasta=fasta, train_chroms=("chr1", "chr2"), eval_chroms=("chr22",), windows=spec)
    prepare(PrepareRequest(out=tmp_path / "serial", **request), workers=1, quiet=True)
    # Tasks of a handful of windows, so that two workers really interleave.
    import genome_lm.data.prepare as prep

    old = prep.TASK_BASES
    prep.TASK_BASES = 3000
    try:
        prepare(PrepareRequest(out=tmp_path / "parallel", **request), workers=2, quiet=True)
    finally:
        prep.TASK_BASES = old
    assert _tree(tmp_path / "serial") == _tree(tmp_path / "parallel")


def test_rerun_reuses_and_force_rebuilds(tmp_path, rng):
    fasta, _ = random_genome(tmp_path, rng)
    request = PrepareRequest(fasta, tmp_path / "out", ("chr1",), ("chr22",), WindowSpec(1000, 1000))
    first = prepare(request, workers=1, quiet=True)
    stamp = (tmp_path / "out" / "train.bin").stat().st_mtime_ns
    again = prepare(request, workers=1, quiet=True)
    assert (first.reused, again.reused) == (False, True)
    assert (tmp_path / "out" / "train.bin").stat().st_mtime_ns == stamp
    forced = prepare(request, workers=1, quiet=True, force=True)
    assert not forced.reused and (tmp_path / "out" / "train.bin").stat().st_mtime_ns != stamp
    changed = PrepareRequest(fasta, tmp_path / "out", ("chr1",), ("chr22",), WindowSpec(500, 500))
    assert not prepare(changed, workers=1, quiet=True).reused
    assert Manifest.load(tmp_path / "out").data["windows"]["window"] == 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"], "no staging or lock files left"


runner = CliRunner()


def _cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    "content,message",
    [
        (b">chr1\nACGTAC\nAC-TAC\n>chr22\nACGT\n", r"record 'chr1' position 9: invalid character '-'"),
        (b">chr1\nACGTAC\nACUTAC\n>chr22\nACGT\n", r"position 9: invalid character 'U'"),
        (b">chr1\nACGT\n>chr1\nACGT\n", "duplicate record name 'chr1'"),
        (b"", "empty file"),
    ],
)
def test_cli_bad_input_one_line_error_and_no_output(tmp_path, content, message):
    fasta = tmp_path / "bad.fa"
    fasta.write_bytes(content)
    result = _cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"), "--window", "4", "--min-tail", "1",
                  "--train-chroms", "chr1", "--eval-chroms", "chr22", "--quiet", "--workers", "1")
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(fasta) in lines[0], result.output
    import re

    assert re.search(message, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.fa"], "nothing half-written"


def test_cli_missing_chromosome_lists_names(tmp_path, rng):
    fasta, _ = random_genome(tmp_path, rng)
    result = _cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"), "--train-chroms", "chr7", "--quiet")
    assert result.exit_code == 1
    assert "no chromosome 'chr7'; records present: chr1, chr2, chr22, chrM" in result.output


def test_cli_unwritable_output(tmp_path, rng):
    fasta, _ = random_genome(tmp_path, rng)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = _cli("prepare", "--fasta", str(fasta), "--out", str(blocker / "out"), "--quiet")
    assert result.exit_code == 1 and "cannot create output folder" in result.output
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        result = _cli("prepare", "--fasta", str(fasta), "--out", str(locked / "out"), "--quiet")
        assert result.exit_code == 1 and "not writable" in result.output


def test_cli_refuses_to_overwrite_a_foreign_folder(tmp_path, rng):
    fasta, _ = random_genome(tmp_path, rng)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    result = _cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "mine"), "--quiet", "--eval-chroms", "")
    assert result.exit_code == 1 and "not a genome-lm dataset" in result.output
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


def _prepare_command(fasta: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "genome_lm", "prepare", "--fasta", str(fasta), "--out", str(out), "--window", "64k",
            "--train-chroms", "chr1", "--eval-chroms", "chr22", "--workers", "1", "--quiet"]


@pytest.mark.slow
def test_killed_run_leaves_no_dataset_and_rerun_matches(tmp_path, rng):
    """SIGKILL at several points; the output is absent or complete, and a rerun gives the same bytes."""
    big = {"chr1": random_sequence(rng, 24_000_000), "chr22": random_sequence(rng, 2_000_000)}
    fasta = write_fasta(tmp_path / "big.fa", big)
    subprocess.run(_prepare_command(fasta, tmp_path / "reference"), check=True)
    out = tmp_path / "out"
    for delay in (0.3, 1.0, 2.0, 3.0, 4.5):
        proc = subprocess.Popen(_prepare_command(fasta, out))
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():  # the kill came after the final rename
            assert _tree(out) == _tree(tmp_path / "reference")
            shutil.rmtree(out)
    subprocess.run(_prepare_command(fasta, out), check=True)
    assert _tree(out) == _tree(tmp_path / "reference")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_cluster_output_is_byte_identical(tmp_path, rng):
    """Start a real local Ray cluster with `ray start --head`, run the tasks on it."""
    ray_bin = Path(sys.executable).with_name("ray")
    port = _free_port()
    # the cluster gets the session's auth token (RAY_AUTH_TOKEN, tests/conftest.py) through env
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    subprocess.run([str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats", f"--temp-dir={temp_dir}"], check=True, env=env, capture_output=True)
    try:
        fasta, _ = random_genome(tmp_path, rng, "bgzf")
        spec = WindowSpec(1000, 1000, "keep", 100)
        request = dict(fasta=fasta, train_chroms=("chr1", "chr2"), eval_chroms=("chr22",), windows=spec)
        prepare(PrepareRequest(out=tmp_path / "serial", **request), workers=1, quiet=True)
        result = prepare(PrepareRequest(out=tmp_path / "ray", **request), ray_address=f"127.0.0.1:{port}", quiet=True)
        assert not result.reused
        assert _tree(tmp_path / "serial") == _tree(tmp_path / "ray")
    finally:
        subprocess.run([str(ray_bin), "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize(
    "name,train,eval_,window",
    [
        ("hg38_chr2_1-2333275.fa.gz", ("2",), (), "16k"),
        ("ecoli_K12_MG1655.fna.gz", ("NC_000913.3",), (), "64k"),
        ("celegans_fragments.fa", ("I",), ("chrII", "CHROMOSOME_X"), "4k"),
    ],
)
def test_real_genomes(tmp_path, rng, name, train, eval_, window):
    fasta = shared_genome(name)
    size = int(window[:-1]) * 1024
    request = PrepareRequest(fasta, tmp_path / "out", train, eval_, WindowSpec(size, size, "keep", 1000))
    manifest = prepare(request, workers=1, quiet=True).manifest
    check_against_pyfaidx(manifest, fasta, tmp_path, rng, n_check=20)
    if name.startswith("hg38"):
        train_split = manifest.split("train")
        assert train_split.data["skipped"][0]["start"] == 0  # the telomeric N run
        soft = sum(w.softmask_frac * w.length for w in train_split.windows) / train_split.n_tokens
        assert 0.30 < soft < 0.40  # SOURCES.md: 35.6% lowercase
        assert manifest.data["source"]["compression"] == "bgzf"


def test_manifest_is_versioned_json(tmp_path, rng):
    fasta, _ = random_genome(tmp_path, rng)
    prepare(PrepareRequest(fasta, tmp_path / "out", ("chr1",), (), WindowSpec(1000, 1000)), workers=1, quiet=True)
    data = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert data["schema"] == "genome-lm.dataset/1"
    assert data["tokenizer"]["vocab"][4:] == ["A", "C", "G", "T", "N"]
    first = data["source"]["records"][0]
    assert data["source"]["sha256"] and first == {"name": "chr1", "length": first["length"]}
    data["schema"] = "genome-lm.dataset/99"
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(data))
    from genome_lm.errors import GenomeLMError

    with pytest.raises(GenomeLMError, match="unsupported manifest schema"):
        Manifest.load(tmp_path / "out")


def test_interrupted_run_resumes_after_the_last_task_written(tmp_path, rng, monkeypatch):
    import genome_lm.data.prepare as prep

    fasta, _ = random_genome(tmp_path, rng)
    monkeypatch.setattr(prep, "TASK_BASES", 2000)  # many small tasks
    request = dict(fasta=fasta, train_chroms=("chr1", "chr2"), eval_chroms=("chr22",), windows=WindowSpec(1000, 1000))
    prepare(PrepareRequest(out=tmp_path / "reference", **request), workers=1, quiet=True)

    calls = []
    real_write = prep._SplitWriter.write

    def write_then_die(self, task, result):
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append(task.index)
        real_write(self, task, result)

    monkeypatch.setattr(prep._SplitWriter, "write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareRequest(out=tmp_path / "out", **request), workers=1, quiet=True)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(prep._SplitWriter, "write", real_write)

    ran = []
    real_run = prep.run_task
    monkeypatch.setattr(prep, "run_task", lambda task, *a: ran.append(task.index) or real_run(task, *a))
    result = prepare(PrepareRequest(out=tmp_path / "out", **request), workers=1, quiet=True)
    assert ran[0] == 5 and 0 not in ran, "tasks written before the interruption are not redone"
    assert _tree(tmp_path / "out") == _tree(tmp_path / "reference")
    assert not result.reused


@pytest.mark.slow
def test_memory_stays_flat_as_chromosomes_grow(tmp_path, rng):
    """Peak RSS (VmHWM of a fresh process) for a 4 Mbp and a 64 Mbp chromosome differ by little."""
    script = (
        "import sys; from pathlib import Path;"
        "from genome_lm.data.prepare import PrepareRequest, prepare;"
        "from genome_lm.data.windows import WindowSpec;"
        "prepare(PrepareRequest(Path(sys.argv[1]), Path(sys.argv[2]), ('chr1',), (), WindowSpec(524288, 524288)),"
        " workers=1, quiet=True);"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
    )
    peaks = {}
    for mbp in (4, 64):
        seq = np.random.default_rng(mbp).choice(np.frombuffer(b"ACGTacgt", dtype=np.uint8), size=mbp << 20).tobytes()
        fasta = write_fasta(tmp_path / f"g{mbp}.fa", {"chr1": seq})
        out = subprocess.run([sys.executable, "-c", script, str(fasta), str(tmp_path / f"out{mbp}")],
                             check=True, capture_output=True, text=True).stdout
        peaks[mbp] = int(out.split()[-1]) / 1024  # MiB
    # 16x the sequence; a task holds at most 32 Mbp of windows, and two tasks are in flight.
    assert peaks[64] - peaks[4] < 150, peaks
    assert peaks[64] < 1500, peaks


def test_eval_stride_overlaps_the_eval_split_only(tmp_path, rng):
    """``eval_stride`` plans the eval split's windows at its own stride (checked against
    plan_windows and pyfaidx), leaves the training split as the window spec says, is recorded in
    the manifest and changes the request's key; without it the key is what it always was."""
    fasta, records = random_genome(tmp_path, rng)
    spec = WindowSpec(1000, 1000, "keep", 100, 1.0)
    plain = PrepareRequest(fasta, tmp_path / "plain", ("chr1",), ("chr22",), spec)
    strided = PrepareRequest(fasta, tmp_path / "out", ("chr1",), ("chr22",), spec, eval_stride=250)
    assert plain.windows_json() == spec.as_json() and strided.key() != plain.key()
    manifest = prepare(strided, workers=1, quiet=True).manifest
    check_against_pyfaidx(manifest, fasta, tmp_path, rng)
    spans = {split: [(w.start, w.end) for w in manifest.split(split).windows] for split in ("train", "eval")}
    assert spans["train"] == plan_windows(len(records["chr1"]), spec)[0]
    assert spans["eval"] == plan_windows(len(records["chr22"]), WindowSpec(1000, 250, "keep", 100, 1.0))[0]
    assert [start for start, _ in spans["eval"]][:4] == [0, 250, 500, 750]
    assert manifest.data["windows"] == {**spec.as_json(), "eval_stride": 250}
    with pytest.raises(ValueError, match="eval stride must be >= 1"):
        PrepareRequest(fasta, tmp_path / "never", ("chr1",), ("chr22",), spec, eval_stride=0)


def test_cli_eval_stride(tmp_path, rng):
    fasta, _ = random_genome(tmp_path, rng)
    common = ("--fasta", str(fasta), "--train-chroms", "chr1", "--eval-chroms", "chr22", "--window", "1000",
              "--min-tail", "100", "--quiet", "--workers", "1")
    result = _cli("prepare", *common, "--out", str(tmp_path / "out"), "--eval-stride", "500")
    assert result.exit_code == 0, result.output
    manifest = Manifest.load(tmp_path / "out")
    starts = [w.start for w in manifest.split("eval").windows]
    assert starts[:3] == [0, 500, 1000] and manifest.data["windows"]["eval_stride"] == 500
    result = _cli("prepare", *common, "--out", str(tmp_path / "bad"), "--eval-stride", "0")
    assert result.exit_code == 2 and "--eval-stride" in result.output and "at least 1" in result.output
    assert not (tmp_path / "bad").exists()


def test_bad_region_leaves_no_new_folders(tmp_path, rng):
    """A region past a record's end is found only once the FASTA is open, after the output's
    parent folders were made: the error leaves none of them behind (and keeps those that were
    there already)."""
    fasta, records = random_genome(tmp_path, rng)
    past = f"chr1:1-{len(records['chr1']) + 1}"
    result = _cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "new" / "deeper" / "out"),
                  "--train-chroms", past, "--eval-chroms", "chr22", "--quiet", "--workers", "1")
    assert result.exit_code == 1 and "reaches past the end of chr1" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    (tmp_path / "kept").mkdir()
    result = _cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "kept" / "out"),
                  "--train-chroms", past, "--eval-chroms", "chr22", "--quiet", "--workers", "1")
    assert result.exit_code == 1 and (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())
