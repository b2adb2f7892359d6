"""The DNA vocabulary: one token per base.

========  =====  ==============================================================
token id  text   meaning
========  =====  ==============================================================
0         <pad>  padding; never a target
1         <bos>  start of a sequence (not written by ``prepare``)
2         <eos>  end of a sequence (not written by ``prepare``)
3         <mask> reserved for masked-language objectives
4         A
5         C
6         G
7         T
8         N      any ambiguous base: N and the IUPAC codes R Y S W K M B D H V;
                 never a training target
========  =====  ==============================================================

Case does not change the token: lowercase (soft-masked, i.e. repeat-annotated) bases get the
token of their uppercase letter; :func:`softmask` gives the per-token soft-mask apart. Any
other byte -- gaps ('-', '.'), 'U', digits, spaces -- is an error naming the position.

Tokenizing is one table look-up over the raw bytes (``np.take``, about 1 Gbp/s per core);
the soft-mask is ASCII's lowercase bit, read without a second look-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD, BOS, EOS, MASK, A, C, G, T, N = range(9)
VOCAB = ("<pad>", "<bos>", "<eos>", "<mask>", "A", "C", "G", "T", "N")
VOCAB_SIZE = len(VOCAB)
BASE_TOKENS = (A, C, G, T)

IUPAC_AMBIGUOUS = "RYSWKMBDHV"
INVALID = 255
LOWERCASE_BIT = 0x20  # ASCII: 'a' == 'A' | 0x20

TOKENIZER_NAME = "genome-lm-dna-v1"


def _token_table() -> np.ndarray:
    table = np.full(256, INVALID, dtype=np.uint8)
    for letter, tok in (("A", A), ("C", C), ("G", G), ("T", T), ("N", N)):
        table[ord(letter)] = table[ord(letter.lower())] = tok
    for letter in IUPAC_AMBIGUOUS:
        table[ord(letter)] = table[ord(letter.lower())] = N
    table.flags.writeable = False
    return table


TOKEN_TABLE = _token_table()


class InvalidBaseError(ValueError):
    """A byte outside the vocabulary; ``offset`` is its index in the tokenized buffer."""

    def __init__(self, offset: int, byte: int):
        self.offset = offset
        self.byte = byte
        super().__init__(f"invalid character {describe_byte(byte)} at offset {offset}")


def describe_byte(byte: int) -> str:
    char = chr(byte)
    return repr(char) if char.isprintable() and byte < 128 else f"byte 0x{byte:02x}"


def as_bytes_array(seq: bytes | np.ndarray) -> np.ndarray:
    return np.frombuffer(seq, dtype=np.uint8) if isinstance(seq, (bytes, bytearray, memoryview)) else seq


def tokenize(seq: bytes | np.ndarray) -> np.ndarray:
    """Map raw sequence bytes ``[L]`` to token ids ``[L]`` uint8.

    Raises :class:`InvalidBaseError` at the first byte outside the vocabulary.
    """
    raw = as_bytes_array(seq)
    tokens = np.take(TOKEN_TABLE, raw)  # np.take: about twice as fast as TOKEN_TABLE[raw] here
    if tokens.size and tokens.max() == INVALID:
        offset = int(np.argmax(tokens == INVALID))
        raise InvalidBaseError(offset, int(raw[offset]))
    return tokens


def softmask(seq: bytes | np.ndarray) -> np.ndarray:
    """``[L]`` bool: which bases are lowercase. Meaningful for bytes :func:`tokenize` accepted
    (all letters), where lowercase is exactly the ASCII lowercase bit."""
    return (as_bytes_array(seq) & LOWERCASE_BIT).astype(bool)


def count_ambiguous(seq: bytes | np.ndarray, tokens: np.ndarray) -> int:
    """How many bases are IUPAC ambiguity codes other than N (they tokenize to N too)."""
    return int(np.count_nonzero(tokens == N) - np.count_nonzero((as_bytes_array(seq) | LOWERCASE_BIT) == ord("n")))


def detokenize(tokens: np.ndarray, soft: np.ndarray | None = None) -> str:
    """Tokens back to text (ambiguity codes come back as N); lowercase where ``soft``."""
    letters = np.frombuffer(b"????ACGTN?", dtype=np.uint8)
    out = letters[np.minimum(tokens, VOCAB_SIZE)].copy()
    if soft is not None:
        out[soft] |= LOWERCASE_BIT
    return out.tobytes().decode("ascii")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer."""

    name: str = TOKENIZER_NAME
    vocab: tuple[str, ...] = VOCAB
    n_token: int = N
    softmask: str = "per token, bit-packed (8 per byte, little-endian), in <split>_softmask.bin"

    def to_json(self) -> dict:
        return {"name": self.name, "vocab": list(self.vocab), "n_token": self.n_token, "softmask": self.softmask}
