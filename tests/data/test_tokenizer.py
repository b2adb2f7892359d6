import numpy as np
import pytest

from genome_lm.data import tokenizer as tk


def naive_tokenize(text: str) -> tuple[list[int], list[int]]:
    """Per-character dictionary reference, written from the vocabulary table in the docs."""
    ids = {"A": 4, "C": 5, "G": 6, "T": 7, "N": 8}
    tokens, flags = [], []
    for ch in text:
        upper = ch.upper()
        if upper in ids:
            tokens.append(ids[upper])
            flags.append(1 if ch.islower() else 0)
        elif upper in "RYSWKMBDHV":
            tokens.append(8)
            flags.append((1 if ch.islower() else 0) | 2)
        else:
            raise ValueError(ch)
    return tokens, flags


def test_matches_naive_reference_on_random_text(rng):
    alphabet = np.frombuffer(b"ACGTNacgtnRYSWKMBDHVryswkmbdhv", dtype=np.uint8)
    for length in (0, 1, 63, 1000):
        raw = rng.choice(alphabet, size=length).tobytes()
        tokens = tk.tokenize(raw)
        ref_tokens, ref_flags = naive_tokenize(raw.decode())
        assert tokens.dtype == np.uint8 and tokens.tolist() == ref_tokens
        assert tk.softmask(raw).tolist() == [bool(f & 1) for f in ref_flags]
        assert tk.count_ambiguous(raw, tokens) == sum(bool(f & 2) for f in ref_flags)


@pytest.mark.parametrize("bad", [b"-", b".", b"U", b"*", b" ", b"\r", b"\x00", b"\xc3", b">"])
def test_invalid_byte_reports_its_offset(bad):
    raw = b"ACGTacgtNN" + bad + b"ACGT"
    with pytest.raises(tk.InvalidBaseError) as info:
        tk.tokenize(raw)
    assert info.value.offset == 10 and info.value.byte == bad[0]


def test_every_byte_is_either_vocabulary_or_invalid():
    for byte in range(256):
        char = chr(byte)
        valid = char.upper() in "ACGTN" + tk.IUPAC_AMBIGUOUS and char.isascii() and char.isalpha()
        assert (tk.TOKEN_TABLE[byte] != tk.INVALID) == valid, char


def test_detokenize_round_trip(rng):
    raw = rng.choice(np.frombuffer(b"ACGTNacgtn", dtype=np.uint8), size=500).tobytes()
    tokens = tk.tokenize(raw)
    assert tk.detokenize(tokens, tk.softmask(raw)) == raw.decode()
    assert tk.detokenize(tokens) == raw.decode().upper()


def test_vocabulary_ids_are_stable():
    # Prepared datasets on disk depend on these ids: changing them is a schema change.
    assert tk.VOCAB == ("<pad>", "<bos>", "<eos>", "<mask>", "A", "C", "G", "T", "N")
    assert (tk.A, tk.C, tk.G, tk.T, tk.N) == (4, 5, 6, 7, 8)
