"""The tokenizer of a Gemma GGUF, built by Kestrel instead of transformers.

A Gemma GGUF stores a SentencePiece BPE vocabulary ("tokenizer.ggml.model" = "llama") with
no merges. transformers up to at least 5.17 rebuilds it as a Unigram model that cuts words
into pieces the model never saw in training ("capital" -> "c", "ap", "it", "al") and adds no
<bos>: Gemma-3-270M imported that way read wiki text at perplexity 183 instead of 19 and
answered "The ciphertal of Frane" on an H200. Newer transformers (5.24) get it right, and
text-generation-webui pins 5.3-5.6, so the import writes this file itself whatever
transformers is installed.

What the GGUF implies (and transformers 5.24 writes; tests/engine/test_gguf_tokenizer.py
compares the two files on the real model):
- the vocabulary in file order; tokens of two or more spaces are stored as spaces but are
  "\u2581" runs in the model's own spelling;
- BPE merges recovered from the vocabulary: every split of a token into two tokens, ranked by
  the merged token's position in the file (Gemma's scores do not follow its merge order),
  the longer left piece first among one token's splits;
- byte fallback for characters outside the vocabulary, spaces as "\u2581", no prefix space;
- control tokens (type 3) as special added tokens, other user-defined ones (type 4: "\\n"
  runs, HTML tags) as added tokens that are not special;
- <bos> added in front of every text when the GGUF says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# gguf's token types (gguf.TokenType): what llama.cpp matches before the model runs.
CONTROL = 3
USER_DEFINED = 4
SPACE = "\u2581"
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def builds_own_tokenizer(reader: Any) -> bool:
    """Whether this GGUF's tokenizer is the kind Kestrel builds: a Gemma SentencePiece BPE
    vocabulary that lists no merges."""
    return (
        _field(reader, "general.architecture") in GEMMA_ARCHITECTURES
        and _field(reader, "tokenizer.ggml.model") == "llama"
        and reader.fields.get("tokenizer.ggml.merges") is None
    )


def _spelled(token: str) -> str:
    """The model's spelling of a vocabulary token: a run of spaces is a run of U+2581."""
    return SPACE * len(token) if token and set(token) == {" "} else token


def bpe_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """Every (left, right) pair whose concatenation is a token, ranked by that token's
    position in `tokens` (earlier merges first), the longer left piece first within one."""
    index = {token: i for i, token in enumerate(tokens)}
    merges = []
    for position, token in enumerate(tokens):
        for cut in range(len(token) - 1, 0, -1):  # longer left piece first
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                merges.append((position, left, right))
    merges.sort(key=lambda m: m[0])  # stable: keeps the within-token order
    return [(left, right) for _, left, right in merges]


def gemma_tokenizer(reader: Any) -> Any:
    """The `tokenizers.Tokenizer` that the GGUF read by `reader` describes (see module)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    raw_tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    if raw_tokens is None or types is None or len(raw_tokens) != len(types):
        raise ValueError("the GGUF's tokenizer.ggml.tokens / token_type are missing or differ")
    tokens = [_spelled(t) for t in raw_tokens]
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=bpe_merges(tokens),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # Added in id order, as the vocabulary lists them (their ids are their vocabulary ids).
    added = [
        AddedToken(token, special=kind == CONTROL, normalized=False)
        for token, raw, kind in zip(tokens, raw_tokens, types, strict=True)
        if kind == CONTROL or (kind == USER_DEFINED and token == raw)
    ]
    tokenizer.add_tokens(added)
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def write_gguf_tokenizer(reader: Any, out_dir: str | Path) -> bool:
    """Replace the tokenizer.json transformers wrote into `out_dir` with Kestrel's own where
    `builds_own_tokenizer` says so of the GGUF `reader` (a gguf.GGUFReader) reads; returns
    whether it did."""
    if not builds_own_tokenizer(reader):
        return False
    gemma_tokenizer(reader).save(str(Path(out_dir) / "tokenizer.json"))
    return True
