import pytest
import torch

from genome_lm.data.tokenizer import VOCAB
from genome_lm.data.vocab import checkpoint_token_map
from genome_lm.errors import GenomeLMError


def write_tokenizer(folder, vocab: dict[str, int]):
    """A real tokenizers.json (WordLevel) as save_pretrained writes it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))


def test_bases_map_onto_single_letter_tokens(tmp_path):
    vocab = {"<unk>": 0, "hello": 1, "A": 40, "C": 41, "G": 50, "T": 33, "N": 60, "<eos>": 7, "AC": 12}
    write_tokenizer(tmp_path, vocab)
    table = checkpoint_token_map(tmp_path, pad_token_id=3)
    expected = {"<pad>": 3, "<bos>": 3, "<eos>": 7, "<mask>": 3, "A": 40, "C": 41, "G": 50, "T": 33, "N": 60}
    assert table.tolist() == [expected[name] for name in VOCAB]
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    assert table[ids].tolist() == [[40, 41, 50, 33, 60]]


def test_missing_letters_and_files_are_named(tmp_path):
    write_tokenizer(tmp_path / "a", {"<unk>": 0, "A": 1, "C": 2, "G": 3, "T": 4})
    with pytest.raises(GenomeLMError, match="no single-letter token for N"):
        checkpoint_token_map(tmp_path / "a", pad_token_id=0)
    with pytest.raises(GenomeLMError, match="tokenizer.json: missing"):
        checkpoint_token_map(tmp_path / "b", pad_token_id=0)
