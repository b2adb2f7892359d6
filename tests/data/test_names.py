import pytest

from genome_lm.data.names import canonical, resolve
from genome_lm.errors import GenomeLMError


@pytest.mark.parametrize(
    "name,key",
    [
        ("chr1", "1"),
        ("1", "1"),
        ("NC_000001.11", "1"),
        ("NC_000001.10", "1"),
        ("CM000663.2", "1"),
        ("chr22", "22"),
        ("NC_000022.11", "22"),
        ("CM000684.2", "22"),
        ("chrX", "X"),
        ("NC_000023.11", "X"),
        ("Y", "Y"),
        ("NC_000024.10", "Y"),
        ("chrM", "M"),
        ("MT", "M"),
        ("NC_012920.1", "M"),
        ("CHROMOSOME_I", "I"),
        ("chrom_07", "7"),
        ("chr1_KI270706v1_random", "1_KI270706V1_RANDOM"),
    ],
)
def test_canonical(name, key):
    assert canonical(name) == key


def test_resolve_prefers_exact_then_unique_canonical():
    present = ["chr1", "chr2", "chr22", "chr1_KI270706v1_random"]
    assert resolve("chr1", present, "g.fa") == "chr1"
    assert resolve("1", present, "g.fa") == "chr1"
    assert resolve("NC_000022.11", present, "g.fa") == "chr22"
    assert resolve("2", ["NC_000001.11", "NC_000002.12"], "g.fa") == "NC_000002.12"


def test_missing_chromosome_lists_names_present():
    with pytest.raises(GenomeLMError, match=r"g\.fa: no chromosome 'chr7'; records present: chr1, chr2"):
        resolve("chr7", ["chr1", "chr2"], "g.fa")


def test_ambiguous_name_is_an_error():
    with pytest.raises(GenomeLMError, match="ambiguous"):
        resolve("1", ["chr1", "NC_000001.11"], "g.fa")
