"""FASTA validation and reading: every bad input gets a one-line error naming the file."""

import gzip

import numpy as np
import pytest

from genome_lm.data import fasta as fasta_mod
from genome_lm.data.fasta import fetch_bytes, open_fasta
from genome_lm.errors import GenomeLMError
from tests.conftest import random_sequence, shared_genome, write_fasta

BAD_INPUTS = {
    "empty file": (b"", "empty file"),
    "blank lines only": (b"\n\n  \n", "empty file"),
    "not FASTA": (b"@read1\nACGT\n+\nIIII\n", "not a FASTA file"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "not a FASTA file"),
    "sequence before header": (b"ACGT\nACGT\n>a\nAC\n", r"sequence before the first header \(line 1\)"),
    "header without name": (b">a\nAC\n> description only\nACGT\n", "header on line 3 has no name"),
    "duplicate names": (b">a\nAC\n>b\nGG\n>a x\nTT\n", r"duplicate record name 'a' \(lines 1 and 5\)"),
    "empty record": (b">a\n>b\nACGT\n", r"record 'a' \(line 1\) has no sequence"),
    "empty last record": (b">a\nACGT\n>b\n\n", r"record 'b' \(line 3\) has no sequence"),
    "ragged lines": (b">a\nACG\nACGTT\nAC\n", "same width"),
}


@pytest.mark.parametrize("compression", ["plain", "gzip", "bgzf"])
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_a_one_line_error(tmp_path, case, compression):
    content, message = BAD_INPUTS[case]
    path = tmp_path / f"bad.fa{'' if compression == 'plain' else '.gz'}"
    if compression == "plain":
        path.write_bytes(content)
    elif compression == "gzip":
        path.write_bytes(gzip.compress(content))
    else:
        plain = tmp_path / "plain.fa"
        plain.write_bytes(content)
        import pysam

        pysam.tabix_compress(str(plain), str(path), force=True)
    with pytest.raises(GenomeLMError, match=message) as info:
        open_fasta(path, tmp_path, tmp_path / "cache")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_truncated_gzip(tmp_path, rng):
    data = gzip.compress(b">a\n" + random_sequence(rng, 50_000) + b"\n")
    path = tmp_path / "t.fa.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GenomeLMError, match="truncated gzip"):
        open_fasta(path, tmp_path, tmp_path / "cache")
    assert not list(tmp_path.glob("*.decompressed.fa*")), "no half-written decompressed copy"


def test_truncated_bgzf(tmp_path, rng):
    path = write_fasta(tmp_path / "t.fa.gz", {"a": random_sequence(rng, 200_000)}, compression="bgzf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GenomeLMError, match="truncated"):
        open_fasta(path, tmp_path, tmp_path / "cache")


def test_missing_file(tmp_path):
    with pytest.raises(GenomeLMError, match="no such file"):
        open_fasta(tmp_path / "nope.fa", tmp_path, tmp_path / "cache")


@pytest.mark.parametrize("compression", ["plain", "gzip", "bgzf"])
@pytest.mark.parametrize("crlf", [False, True])
def test_reads_what_was_written(tmp_path, rng, compression, crlf):
    records = {f"r{i}": random_sequence(rng, int(rng.integers(1, 5000))) for i in range(5)}
    path = write_fasta(tmp_path / "g.fa.gz", records, width=int(rng.integers(10, 100)), compression=compression,
                       crlf=crlf)
    source = open_fasta(path, tmp_path, tmp_path / "cache")
    assert source.names() == list(records) and source.compression == compression
    reader = source.handle.open()
    for name, seq in records.items():
        assert source.length(name) == len(seq)
        assert fetch_bytes(reader, source.handle, name, 0, len(seq)) == seq
        a = int(rng.integers(0, len(seq)))
        b = int(rng.integers(a, len(seq) + 1))
        assert fetch_bytes(reader, source.handle, name, a, b) == seq[a:b]


def test_header_scan_across_chunk_boundaries(tmp_path, rng, monkeypatch):
    """Tiny chunks cut headers and newlines at every possible place."""
    records = {f"chr{i}_with_a_long_name": random_sequence(rng, int(rng.integers(1, 300))) for i in range(30)}
    path = write_fasta(tmp_path / "g.fa", records, width=17)
    for chunk in (1, 2, 3, 7, 64):
        monkeypatch.setattr(fasta_mod, "CHUNK", chunk)
        assert open_fasta(path, tmp_path, tmp_path / f"cache{chunk}").names() == list(records)
    dup = tmp_path / "dup.fa"
    dup.write_bytes(path.read_bytes() + b">chr3_with_a_long_name\nACGT\n")
    empty = tmp_path / "empty.fa"
    empty.write_bytes(path.read_bytes().replace(b"\n>chr5_", b"\n>nothing here\n\n\n>chr5_"))
    for chunk in (1, 2, 5, 13):
        monkeypatch.setattr(fasta_mod, "CHUNK", chunk)
        with pytest.raises(GenomeLMError, match="duplicate record name 'chr3_with_a_long_name'"):
            open_fasta(dup, tmp_path, tmp_path / "cache")
        with pytest.raises(GenomeLMError, match=r"record 'nothing' \(line \d+\) has no sequence"):
            open_fasta(empty, tmp_path, tmp_path / "cache")


def test_index_is_built_in_the_cache_not_beside_the_input(tmp_path, rng):
    path = write_fasta(tmp_path / "in" / "g.fa", {"a": random_sequence(rng, 1000)})
    source = open_fasta(path, tmp_path, tmp_path / "cache")
    assert not (tmp_path / "in" / "g.fa.fai").exists()
    assert source.handle.fai_path.startswith(str(tmp_path / "cache"))


def test_existing_index_beside_input_is_used(tmp_path, rng):
    import pysam

    path = write_fasta(tmp_path / "g.fa", {"a": random_sequence(rng, 1000)})
    pysam.faidx(str(path))
    source = open_fasta(path, tmp_path, tmp_path / "cache")
    assert source.handle.fai_path == str(path) + ".fai"
    assert not (tmp_path / "cache").exists()


def test_non_ascii_byte_is_reported_with_position(tmp_path):
    path = tmp_path / "g.fa"
    path.write_bytes(b">a\nACGTA\nAC\xc3\xa9T\n")
    source = open_fasta(path, tmp_path, tmp_path / "cache")
    with pytest.raises(GenomeLMError, match=r"record 'a' position 8: invalid character byte 0xc3"):
        fetch_bytes(source.handle.open(), source.handle, "a", 0, 10)


@pytest.mark.parametrize(
    "name,records,compression",
    [
        ("hg38_chr2_1-2333275.fa.gz", ["chr2"], "bgzf"),
        ("ecoli_K12_MG1655.fna.gz", ["NC_000913.3"], "gzip"),
        ("celegans_fragments.fa", ["CHROMOSOME_I", "CHROMOSOME_II"], "plain"),
    ],
)
def test_real_genomes_open(tmp_path, name, records, compression):
    source = open_fasta(shared_genome(name), tmp_path, tmp_path / "cache")
    assert source.compression == compression
    assert source.names()[: len(records)] == records
    assert source.identity["compression"] == compression
    np.testing.assert_array_less(0, [r.length for r in source.records])
