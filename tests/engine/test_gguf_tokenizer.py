"""engine/gguf_tokenizer.py: a Gemma GGUF's tokenizer built from its vocabulary, as BPE whose
merges follow the vocabulary's order (not its scores), whatever transformers is installed.

The GGUF here is written with gguf's own writer, the way llama.cpp writes a Gemma file: a
SentencePiece ("llama") vocabulary with scores, token types and no merges. Its scores run
against the file order, so a tokenizer ranked by score (or a Unigram model, what transformers
5.17 built) cuts the words differently. The real Gemma-3-270M vocabulary is checked in
tests/loader/test_real_models.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.gguf_import import fast_gguf_reader_class
from engine.gguf_tokenizer import bpe_merges, builds_own_tokenizer, write_gguf_tokenizer

pytest.importorskip("gguf")

# (token as the file stores it, gguf token type); the position is the id and the merge rank.
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
VOCAB = [
    ("<pad>", CONTROL),
    ("<eos>", CONTROL),
    ("<bos>", CONTROL),
    ("<unk>", CONTROL),
    ("<start_of_turn>", CONTROL),
    ("\n\n", USER_DEFINED),
    ("  ", USER_DEFINED),  # two spaces: "\u2581\u2581" to the model
    ("<0x21>", BYTE),  # "!"
    ("\u2581", NORMAL),
    *((c, NORMAL) for c in "helowrd"),
    ("ll", NORMAL),
    ("he", NORMAL),
    ("lo", NORMAL),
    ("hell", NORMAL),
    ("\u2581w", NORMAL),
    ("or", NORMAL),
    ("\u2581wor", NORMAL),
    ("ld", NORMAL),
    ("hello", NORMAL),
]
IDS = {token: i for i, (token, _) in enumerate(VOCAB)}


def _write_gemma_gguf(path: Path, *, architecture: str = "gemma3", merges: bool = False) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in VOCAB])
    # Scores that rise with the position: ranked by score, "hello" would merge first.
    writer.add_token_scores([float(i) for i in range(len(VOCAB))])
    writer.add_token_types([kind for _, kind in VOCAB])
    if merges:
        writer.add_token_merges(["l l"])
    writer.add_bos_token_id(IDS["<bos>"])
    writer.add_eos_token_id(IDS["<eos>"])
    writer.add_unk_token_id(IDS["<unk>"])
    writer.add_pad_token_id(IDS["<pad>"])
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _read(path: Path):
    return fast_gguf_reader_class()(str(path))


@pytest.fixture
def tokenizer(tmp_path: Path) -> Tokenizer:
    _write_gemma_gguf(tmp_path / "gemma.gguf")
    assert write_gguf_tokenizer(_read(tmp_path / "gemma.gguf"), tmp_path)
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return tokenizer.encode(text).tokens


def test_merges_follow_the_vocabulary_order_not_the_scores(tokenizer: Tokenizer) -> None:
    # ll, he, hell, ▁w, or, ▁wor, ld, hello in file order; by score "lo" would come before
    # "hell" and leave "he" "l" "lo".
    assert _pieces(tokenizer, "hello world") == ["<bos>", "hello", "\u2581wor", "ld"]
    assert tokenizer.decode(tokenizer.encode("hello world").ids) == "hello world"


def test_runs_of_spaces_are_the_models_own_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("he  he").ids
    assert ids == [IDS["<bos>"], IDS["he"], IDS["  "], IDS["he"]]
    assert tokenizer.decode(ids) == "he  he"


def test_control_and_user_defined_tokens_are_matched_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<start_of_turn>hello\n\nhello").ids
    assert ids == [IDS["<bos>"], IDS["<start_of_turn>"], IDS["hello"], IDS["\n\n"], IDS["hello"]]
    # Control tokens are special (dropped when decoding for the user), "\n\n" is text.
    assert tokenizer.decode(ids) == "hello\n\nhello"


def test_characters_outside_the_vocabulary_fall_back_to_bytes_or_unk(
    tokenizer: Tokenizer,
) -> None:
    assert tokenizer.encode("he!").ids == [IDS["<bos>"], IDS["he"], IDS["<0x21>"]]
    assert tokenizer.encode("z").ids == [IDS["<bos>"], IDS["<unk>"]]


def test_only_gemma_vocabularies_without_merges_are_rebuilt(tmp_path: Path) -> None:
    cases = {"gemma3": True, "gemma2": True, "llama": False}
    for architecture, expected in cases.items():
        path = tmp_path / f"{architecture}.gguf"
        _write_gemma_gguf(path, architecture=architecture)
        assert builds_own_tokenizer(_read(path)) is expected
    _write_gemma_gguf(tmp_path / "merges.gguf", merges=True)
    assert not builds_own_tokenizer(_read(tmp_path / "merges.gguf"))
    # Not rebuilt: the directory is left as it was.
    assert not write_gguf_tokenizer(_read(tmp_path / "merges.gguf"), tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_bpe_merges_rank_by_the_merged_tokens_position() -> None:
    tokens = ["a", "b", "c", "abc", "ab", "bc"]
    # "abc" (position 3) splits as ab|c (longer left piece first) and a|bc.
    assert bpe_merges(tokens) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
