"""Reading variants from a VCF against a FASTA: splitting, name matching, trimming, windows, skips."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import numpy as np
import pysam
import pytest

from genome_lm.errors import GenomeLMError
from genome_lm.variants.vcf import Reference, Skipped, Variant, read_variants, windows
from tests.conftest import write_fasta

SHARED_VARIANTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "variants"

# record "1": 300 random bases, soft-masked at 30-59 (0-based), N at 250-255
SEQ = "".join(np.random.default_rng(7).choice(list("ACGT"), size=300))
SEQ = SEQ[:30] + SEQ[30:60].lower() + SEQ[60:250] + "N" * 6 + SEQ[256:]
L = R = 10  # window flanks used throughout

HEADER = """##fileformat=VCFv4.2
##INFO=<ID=AF,Number=A,Type=Float,Description="allele frequency">
##INFO=<ID=AC,Number=R,Type=Integer,Description="allele counts, REF first">
##INFO=<ID=DP,Number=1,Type=Integer,Description="depth">
##INFO=<ID=SOMATIC,Number=0,Type=Flag,Description="somatic">
##INFO=<ID=TAGS,Number=.,Type=String,Description="tags">
##INFO=<ID=CLASS,Number=1,Type=String,Description="class">
"""


def base(pos: int) -> str:
    """The reference base at 1-based ``pos`` of record 1, uppercase."""
    return SEQ[pos - 1].upper()


def other(pos: int, k: int = 1) -> str:
    """A base other than the reference at ``pos``."""
    bases = "ACGT"
    return bases[(bases.index(base(pos)) + k) % 4]


def write_genome(tmp_path: Path, name: str = "1") -> Path:
    return write_fasta(tmp_path / "genome.fa", {name: SEQ.encode()}, width=60)


def write_vcf(path: Path, rows: list[tuple], compress: bool = False) -> Path:
    """rows: (chrom, pos, ref, alt, info) sorted by position; ``compress``: bgzip + tabix."""
    contigs = "".join(f"##contig=<ID={c}>\n" for c in dict.fromkeys(row[0] for row in rows))
    lines = [f"{chrom}\t{pos}\t.\t{ref}\t{alt}\t.\tPASS\t{info or '.'}\n" for chrom, pos, ref, alt, info in rows]
    path.write_text(HEADER + contigs + "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n" + "".join(lines))
    if compress:
        return Path(pysam.tabix_index(str(path), preset="vcf", force=True))
    return path


def read(vcf: Path, fasta: Path, **kwargs):
    return read_variants(vcf, fasta, **{"left": L, "right": R, **kwargs})


def test_snv_fields_and_windows(tmp_path):
    fasta = write_genome(tmp_path)
    vcf = write_vcf(tmp_path / "v.vcf", [("1", 45, base(45), other(45), "DP=3"), ("1", 100, base(100), other(100), "")],
                    compress=True)
    result = read(vcf, fasta)
    assert result.skipped == [] and result.labels is None
    masked, snv = result.variants  # the first lies in the soft-masked stretch: REF matches regardless of case
    assert (snv.chrom, snv.contig, snv.pos, snv.id) == ("1", "1", 100, None)
    assert (snv.start, snv.end, snv.ref_allele, snv.alt_allele, snv.kind) == (99, 100, base(100), other(100), "snv")
    assert snv.key == f"1:100:{base(100)}>{other(100)}"
    assert masked.info == {"DP": 3, "SOMATIC": False}
    with Reference(fasta) as ref:
        ref_window, alt_window, offset = windows(snv, ref, L, R)
        assert ref_window == SEQ[89:110].upper()
        assert alt_window == SEQ[89:99].upper() + other(100) + SEQ[100:110].upper()
        assert offset == L
        assert windows(masked, ref, L, R)[0] == SEQ[34:55].upper()
        with pytest.raises(GenomeLMError, match="not inside record"):
            windows(snv, ref, 100, 1000)


def test_multiallelic_record_splits_with_per_allele_info(tmp_path):
    fasta = write_genome(tmp_path)
    alts = f"{other(120, 1)},{other(120, 2)}"
    vcf = write_vcf(tmp_path / "v.vcf", [("1", 120, base(120), alts, "AF=0.25,0.5;AC=5,3,2;DP=7;SOMATIC;TAGS=x,y")])
    first, second = read(vcf, fasta).variants
    assert (first.alt, second.alt) == (other(120, 1), other(120, 2))
    assert first.pos == second.pos == 120
    assert first.info == {"AF": 0.25, "AC": (5, 3), "DP": 7, "SOMATIC": True, "TAGS": ("x", "y")}
    assert second.info == {"AF": 0.5, "AC": (5, 2), "DP": 7, "SOMATIC": True, "TAGS": ("x", "y")}


def test_insertion_and_deletion_are_trimmed(tmp_path):
    fasta = write_genome(tmp_path)
    rows = [("1", 150, base(150), base(150) + "GGA", ""), ("1", 170, SEQ[169:174], base(170), "")]
    ins, dele = read(write_vcf(tmp_path / "v.vcf", rows), fasta).variants
    assert (ins.start, ins.end, ins.ref_allele, ins.alt_allele, ins.kind) == (150, 150, "", "GGA", "insertion")
    expected = (170, 174, SEQ[170:174].upper(), "", "deletion")
    assert (dele.start, dele.end, dele.ref_allele, dele.alt_allele, dele.kind) == expected
    up = SEQ.upper()
    with Reference(fasta) as ref:
        assert windows(ins, ref, L, R) == (up[140:160], up[140:150] + "GGA" + up[150:160], L)
        assert windows(dele, ref, L, R) == (up[160:184], up[160:170] + up[174:184], L)


@pytest.mark.parametrize(
    "pos, ref, alt, start, end, ref_allele, alt_allele, kind",
    [
        (10, "A", "G", 9, 10, "A", "G", "snv"),
        (10, "AC", "GT", 9, 11, "AC", "GT", "mnv"),
        (10, "AC", "TC", 9, 10, "A", "T", "snv"),  # a shared last base is not part of the change
        (10, "ACT", "AGGT", 10, 11, "C", "GG", "complex"),
        (10, "ATT", "AT", 11, 12, "T", "", "deletion"),  # leading bases are trimmed first
        (10, "a", "atg", 10, 10, "", "TG", "insertion"),
    ],
)
def test_trimming_by_hand(pos, ref, alt, start, end, ref_allele, alt_allele, kind):
    v = Variant("chr1", "1", pos, ref, alt)
    assert (v.start, v.end, v.ref_allele, v.alt_allele, v.kind) == (start, end, ref_allele, alt_allele, kind)
    assert v.key == f"chr1:{pos}:{ref}>{alt}"
    assert len({v, Variant("chr1", "1", pos, ref, alt)}) == 1  # hashable despite the info dict


def test_alt_equal_to_ref_is_not_a_variant():
    with pytest.raises(ValueError, match="ALT equals REF"):
        Variant("1", "1", 5, "A", "a")


def test_unscorable_variants_are_skipped_with_reasons(tmp_path):
    fasta = write_genome(tmp_path)
    deletion = SEQ[109:118].upper()  # 8 bases after the anchor
    breakend = f"{base(131)}]1:200]"
    rows = [
        ("1", 5, base(5), other(5), ""),
        ("1", 100, other(100), base(100), ""),
        ("1", 110, deletion, base(110), ""),
        ("1", 130, base(130), "<DEL>", ""),
        ("1", 131, base(131), breakend, ""),
        ("1", 132, base(132), f"*,{other(132)}", ""),  # the second ALT is fine
        ("1", 245, base(245), other(245), ""),
        ("1", 295, base(295), other(295), ""),
    ]
    result = read(write_vcf(tmp_path / "v.vcf", rows), fasta, max_indel=5)
    assert [v.key for v in result.variants] == [f"1:132:{base(132)}>{other(132)}"]
    assert [(s.key, s.reason) for s in result.skipped] == [
        (f"1:5:{base(5)}>{other(5)}", "window runs off the record's start"),
        (f"1:100:{other(100)}>{base(100)}", f"REF does not match the FASTA ({base(100)} at 1:100)"),
        (f"1:110:{deletion}>{base(110)}", "indel longer than 5 (8 bases)"),
        (f"1:130:{base(130)}><DEL>", "symbolic or breakend ALT"),
        (f"1:131:{base(131)}>{breakend}", "symbolic or breakend ALT"),
        (f"1:132:{base(132)}>*", "symbolic or breakend ALT"),
        (f"1:245:{base(245)}>{other(245)}", "window runs into N"),  # the N at 250
        (f"1:295:{base(295)}>{other(295)}", "window runs off the record's end"),  # the record ends at 300
    ]
    assert len(read(write_vcf(tmp_path / "w.vcf", rows[2:3]), fasta, max_indel=8).variants) == 1


def test_strict_turns_a_skip_into_an_error(tmp_path):
    fasta = write_genome(tmp_path)
    vcf = write_vcf(tmp_path / "v.vcf", [("1", 100, other(100), base(100), "")])
    with pytest.raises(GenomeLMError, match=rf"v\.vcf: variant 1:100:{other(100)}>{base(100)}: REF does not match"):
        read(vcf, fasta, strict=True)


@pytest.mark.parametrize("vcf_name, fasta_name", [("chr1", "1"), ("1", "chr1"), ("MT", "chrM"), ("chrM", "MT")])
def test_chromosome_names_match_across_conventions(tmp_path, vcf_name, fasta_name):
    fasta = write_genome(tmp_path, fasta_name)
    (v,) = read(write_vcf(tmp_path / "v.vcf", [(vcf_name, 100, base(100), other(100), "")]), fasta).variants
    assert (v.chrom, v.contig) == (vcf_name, fasta_name)
    assert v.key.startswith(f"{vcf_name}:100:")


def test_unknown_chromosome_is_skipped_or_an_error_when_nothing_places(tmp_path):
    fasta = write_genome(tmp_path)
    rows = [("1", 100, base(100), other(100), ""), ("chr9", 100, "A", "C", "")]
    result = read(write_vcf(tmp_path / "v.vcf", rows), fasta)
    assert len(result.variants) == 1
    assert result.skipped == [Skipped("chr9:100:A>C", "chromosome chr9 not in the FASTA")]
    message = r"w\.vcf: none of its chromosomes \(chr9\) is in .*genome\.fa \(records: 1\)"
    with pytest.raises(GenomeLMError, match=message):
        read(write_vcf(tmp_path / "w.vcf", rows[1:]), fasta)


def test_labels(tmp_path):
    fasta = write_genome(tmp_path)
    classes = ["CLASS=LOF", "CLASS=lof", "CLASS=FUNC", "CLASS=INT", ""]
    rows = [("1", p, base(p), other(p), c) for p, c in zip(range(100, 105), classes)]
    vcf = write_vcf(tmp_path / "v.vcf", rows)
    result = read(vcf, fasta, label="CLASS", positive=["lof"])
    assert [v.pos for v in result.variants] == [100, 101, 102, 103]
    assert result.labels == [1, 1, 0, 0]
    assert result.skipped == [Skipped(f"1:104:{base(104)}>{other(104)}", "no label")]
    result = read(vcf, fasta, label="CLASS", positive=["LOF"], negative=["Func"])
    assert [v.pos for v in result.variants] == [100, 101, 102]
    assert result.labels == [1, 1, 0]
    assert [s.reason for s in result.skipped] == ["CLASS=INT is neither positive nor negative", "no label"]


def test_existing_index_beside_the_fasta_is_used_and_none_is_written_there(tmp_path):
    beside = write_fasta(tmp_path / "a" / "genome.fa", {"1": SEQ.encode()})
    pysam.faidx(str(beside))
    plain = write_fasta(tmp_path / "b" / "genome.fa", {"1": SEQ.encode()})
    vcf = write_vcf(tmp_path / "v.vcf", [("1", 100, base(100), other(100), "")])
    for fasta in (beside, plain):
        assert len(read(vcf, fasta).variants) == 1
    assert not Path(str(plain) + ".fai").exists()  # indexed into the cache folder instead


def test_bgzip_fasta(tmp_path):
    fasta = write_fasta(tmp_path / "genome.fa.gz", {"1": SEQ.encode()}, compression="bgzf")
    vcf = write_vcf(tmp_path / "v.vcf", [("1", 100, base(100), other(100), "")])
    assert len(read(vcf, fasta).variants) == 1


def test_errors_name_the_file(tmp_path):
    fasta = write_genome(tmp_path)
    vcf = write_vcf(tmp_path / "v.vcf", [("1", 100, base(100), other(100), "")])
    with pytest.raises(GenomeLMError, match=r"missing\.vcf: no such file"):
        read(tmp_path / "missing.vcf", fasta)
    with pytest.raises(GenomeLMError, match=r"missing\.fa: no such file"):
        read(vcf, tmp_path / "missing.fa")
    with pytest.raises(GenomeLMError, match=r"v\.vcf: no INFO field 'FUNC_CLASS' in the header \(declared: AF, AC, DP"):
        read(vcf, fasta, label="FUNC_CLASS", positive=["LOF"])
    ragged = tmp_path / "ragged.fa"
    ragged.write_text(">1\nACG\nACGTT\nAC\n")
    with pytest.raises(GenomeLMError, match=r"ragged\.fa: cannot index"):
        read(vcf, ragged)
    gz = tmp_path / "genome.fa.gz"
    gz.write_bytes(gzip.compress(b">1\nACGT\n"))
    with pytest.raises(GenomeLMError, match=r"genome\.fa\.gz: a plain-gzip FASTA cannot be indexed"):
        read(vcf, gz)
    not_vcf = tmp_path / "not.vcf"
    not_vcf.write_text("hello\n")
    with pytest.raises(GenomeLMError, match=r"not\.vcf: cannot read"):
        read(not_vcf, fasta)


def test_findlay_brca1_set():
    """The published BRCA1 saturation genome editing set reads completely at Evo 2's 8 kbp windows."""
    vcf, fasta = SHARED_VARIANTS / "findlay2018_brca1_sge.vcf.gz", SHARED_VARIANTS / "brca1_hg19.fa.gz"
    if not (vcf.exists() and fasta.exists()):
        pytest.skip(f"{SHARED_VARIANTS} not present (see its SOURCES.md)")
    result = read_variants(vcf, fasta, left=4096, right=4096, label="FUNC_CLASS", positive=["LOF"])
    assert result.skipped == []
    assert len(result.variants) == 3893
    assert Counter(result.labels) == {1: 823, 0: 3070}
    assert Counter(v.info["FUNC_CLASS"] for v in result.variants) == {"FUNC": 2821, "INT": 249, "LOF": 823}
    with Reference(fasta) as ref:
        for v in result.variants:
            assert (v.kind, v.contig) == ("snv", "17")
            ref_window, alt_window, offset = windows(v, ref, 4096, 4096)
            assert len(ref_window) == len(alt_window) == 8193 and offset == 4096
            assert (ref_window[offset], alt_window[offset]) == (v.ref, v.alt)
            assert ref_window[:offset] == alt_window[:offset] and ref_window[offset + 1 :] == alt_window[offset + 1 :]
