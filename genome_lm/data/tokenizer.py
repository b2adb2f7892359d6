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
token of their uppercase letter, and the soft-mask is kept as bit 0 of a per-token flag byte.
Bit 1 of the flag marks an IUPAC ambiguity code other than N (so a user can see how much of a
window such letters cover). Any other byte -- gaps ('-', '.'), 'U', digits, spaces -- is an
error naming the record and position.

Tokenizing is two table look-ups over the raw bytes (numpy fancy indexing), so it runs at
memory speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD, BOS, EOS, MASK, A, C, G, T, N = range(9)
VOCAB = ("<pad>", "<bos>", "<eos>", "<mask>", "A", "C", "G", "T", "N")
VOCAB_SIZE = len(VOCAB)
BASE_TOKENS = (A, C, G, T)

FLAG_SOFTMASK = 1
FLAG_AMBIGUOUS = 2

IUPAC_AMBIGUOUS = "RYSWKMBDHV"
INVALID = 255

TOKENIZER_NAME = "genome-lm-dna-v1"


def _tables() -> tuple[np.ndarray, np.ndarray]:
    token = np.full(256, INVALID, dtype=np.uint8)
    flag = np.zeros(256, dtype=np.uint8)
    for letter, tok in (("A", A), ("C", C), ("G", G), ("T", T), ("N", N)):
        token[ord(letter)] = token[ord(letter.lower())] = tok
    for letter in IUPAC_AMBIGUOUS:
        token[ord(letter)] = token[ord(letter.lower())] = N
        flag[ord(letter)] = flag[ord(letter.lower())] = FLAG_AMBIGUOUS
    for code in range(ord("a"), ord("z") + 1):
        if token[code] != INVALID:
            flag[code] |= FLAG_SOFTMASK
    return token, flag


TOKEN_TABLE, FLAG_TABLE = _tables()
TOKEN_TABLE.flags.writeable = False
FLAG_TABLE.flags.writeable = False


class InvalidBaseError(ValueError):
    """A byte outside the vocabulary; ``offset`` is its index in the tokenized buffer."""

    def __init__(self, offset: int, byte: int):
        self.offset = offset
        self.byte = byte
        super().__init__(f"invalid character {describe_byte(byte)} at offset {offset}")


def describe_byte(byte: int) -> str:
    char = chr(byte)
    return repr(char) if char.isprintable() and byte < 128 else f"byte 0x{byte:02x}"


def tokenize(seq: bytes | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map raw sequence bytes to ``(tokens [L] uint8, flags [L] uint8)``.

    Raises :class:`InvalidBaseError` at the first byte outside the vocabulary.
    """
    raw = np.frombuffer(seq, dtype=np.uint8) if isinstance(seq, (bytes, bytearray, memoryview)) else seq
    tokens = TOKEN_TABLE[raw]
    if tokens.size and tokens.max() == INVALID:
        offset = int(np.argmax(tokens == INVALID))
        raise InvalidBaseError(offset, int(raw[offset]))
    return tokens, FLAG_TABLE[raw]


def detokenize(tokens: np.ndarray, flags: np.ndarray | None = None) -> str:
    """Tokens back to text (ambiguity codes come back as N); lowercase where soft-masked."""
    letters = np.frombuffer(b"????ACGTN?", dtype=np.uint8)
    out = letters[np.minimum(tokens, VOCAB_SIZE)].copy()
    if flags is not None:
        soft = (flags & FLAG_SOFTMASK).astype(bool)
        out[soft] = out[soft] + 32
    return out.tobytes().decode("ascii")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer."""

    name: str = TOKENIZER_NAME
    vocab: tuple[str, ...] = VOCAB
    n_token: int = N
    flag_bits: tuple[tuple[str, int], ...] = (("softmask", FLAG_SOFTMASK), ("ambiguous", FLAG_AMBIGUOUS))

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "vocab": list(self.vocab),
            "n_token": self.n_token,
            "flag_bits": dict(self.flag_bits),
        }
