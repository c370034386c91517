"""Tokenizer layer: text <-> token ids for a Hugging Face model directory, plus chat templates
and exact incremental detokenization.

Contract:
- `Tokenizer.from_dir(path)` loads `tokenizer.json` (the `tokenizers` library) if present, else
  SentencePiece `tokenizer.model`; neither raises `TokenizerFilesNotFound` (a FileNotFoundError
  and a `TokenizerError`, itself a ValueError). Special-token ids come from tokenizer_config.json,
  config.json and generation_config.json (see `from_dir`).
- `encode(text, add_bos=True, special=True)` never lets the backend add its own special tokens;
  BOS is prepended here, once. With `special=True` special-token strings in the text (e.g.
  "<|im_start|>") become their ids; with `special=False` they are plain text (use it for
  untrusted user text). SentencePiece has no notion of added tokens, so for it the text is split
  on the added/control token strings here (best effort: the `lstrip`/`rstrip`/`single_word`
  flags of added tokens are ignored); text after such a token gets no dummy-prefix space unless
  tokenizer_config says `"legacy": true`, as transformers does.
- `decode(ids, skip_special=True)` matches transformers' decode with
  `clean_up_tokenization_spaces=False`: Kestrel never applies that lossy clean-up, since it would
  make streamed text differ from the final text. For SentencePiece, plain text follows the
  sentencepiece library itself (which the models were trained with) where transformers' converted
  tokenizer differs: text with leading whitespace still gets the dummy-prefix space.
- `token_bytes(id)` is the token's raw bytes: GPT-2 byte-level pieces are mapped back to bytes,
  `<0xAB>` byte-fallback pieces are one byte, '▁' is a space; special tokens give their text.
- `IncrementalDecoder` streams text whose concatenation equals `decode(all ids)` whenever that
  is valid UTF-8; an incomplete trailing UTF-8 sequence is held back, never emitted as U+FFFD.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    render_chat_template,
    select_template,
)

__all__ = [
    "ChatTemplateError",
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerError",
    "TokenizerFilesNotFound",
]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"  # SentencePiece's '▁'
_NAMED_SPECIALS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")

# sentencepiece turns each byte of an invalid UTF-8 sequence into its own U+FFFD; Python's
# "replace" would merge a truncated sequence into one.
_PER_BYTE_REPLACE = "kestrel-per-byte-replace"


def _per_byte_replace(error: UnicodeError) -> tuple[str, int]:
    assert isinstance(error, UnicodeDecodeError)  # registered for decoding only
    return "\ufffd" * (error.end - error.start), error.end


codecs.register_error(_PER_BYTE_REPLACE, _per_byte_replace)


class TokenizerError(ValueError):
    """A tokenizer directory or file is unusable."""


class TokenizerFilesNotFound(TokenizerError, FileNotFoundError):
    """Neither tokenizer.json nor tokenizer.model exists in the model directory."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens as strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    # config files hold an id, a list of ids, or null
    return [v for v in (value if isinstance(value, list) else [value]) if type(v) is int]


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    # Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100+.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class _HFBackend:
    """A `tokenizers` tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        self._path = path
        raw = path.read_text(encoding="utf-8")
        spec = json.loads(raw)
        self.tok = RawTokenizer.from_str(raw)
        self._plain_tok: Any = None
        self.added = {t["id"]: t["content"] for t in spec.get("added_tokens") or ()}
        self.special_ids = {t["id"] for t in spec.get("added_tokens") or () if t.get("special")}
        # The decoder says how pieces map to bytes: GPT-2 byte-level, or '▁' + <0xAB> fallback.
        decoder = json.dumps(spec.get("decoder"), ensure_ascii=False)
        self.byte_level = '"ByteLevel"' in decoder
        self.space_mark = any(k in decoder for k in ('"ByteFallback"', '"Metaspace"', _SPACE_MARK))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def encode(self, text: str, special: bool) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: a megabyte of text
        # would stop every other thread, the API's event loop included, for seconds).
        if special:
            return self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        if self._plain_tok is None:
            # A second instance, so that toggling the flag never races with other callers.
            from tokenizers import Tokenizer as RawTokenizer

            self._plain_tok = RawTokenizer.from_file(str(self._path))
            self._plain_tok.encode_special_tokens = True
        ids: list[int] = self._plain_tok.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def piece(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return str(self.added[token_id]).encode()
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if self.space_mark:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace(_SPACE_MARK, " ").encode()
        return piece.encode()

    def default_id(self, name: str) -> int | None:
        return None

    def adds_bos(self, bos_id: int) -> bool:
        # Ask the post-processor itself rather than parsing its many JSON forms.
        with_specials = self.tok.encode("a", add_special_tokens=True).ids
        plain = self.tok.encode("a", add_special_tokens=False).ids
        return with_specials[:1] == [bos_id] and plain[:1] != [bos_id]

    def closing_ids(self) -> list[int]:
        """Special tokens the post-processor appends after the text (Qwen3-Embedding's
        <|endoftext|>, a BERT-style [SEP]); [] for most chat models."""
        with_specials = self.tok.encode("a", add_special_tokens=True).ids
        plain = self.tok.encode("a", add_special_tokens=False).ids
        at = len(with_specials) - len(plain)
        while at >= 0 and with_specials[at : at + len(plain)] != plain:
            at -= 1
        return with_specials[at + len(plain) :] if at >= 0 else []


class _SPBackend:
    """A SentencePiece tokenizer.model, plus added tokens from tokenizer_config.json."""

    def __init__(self, path: Path, tokenizer_config: dict[str, Any]) -> None:
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.sp_size = self.sp.get_piece_size()
        self.added: dict[int, str] = {}
        self.special_ids: set[int] = set()
        for i in range(self.sp_size):
            if self.sp.is_control(i) or self.sp.is_unknown(i):
                self.added[i] = self.sp.id_to_piece(i)
                self.special_ids.add(i)
        for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
            text = _token_text(entry)
            if text is not None:
                self.added[int(key)] = text
                if isinstance(entry, dict) and entry.get("special", True):
                    self.special_ids.add(int(key))
        # Several ids may share a text (e.g. "<s>" twice); the lowest id wins.
        self.by_text = {text: i for i, text in sorted(self.added.items(), reverse=True)}
        self._split_all = self._splitter(self.added)
        plain_added = {i: t for i, t in self.added.items() if i not in self.special_ids}
        self._split_plain = self._splitter(plain_added)
        self.vocab_size = max(self.sp_size, max(self.added, default=-1) + 1)
        probe = self.sp.encode("a", out_type=str)
        self.dummy_prefix = bool(probe) and probe[0].startswith(_SPACE_MARK)
        self.legacy = bool(tokenizer_config.get("legacy", False))
        unk = self.sp.unk_id()
        self._marker = self.sp.id_to_piece(unk) if unk >= 0 else "<unk>"
        self._marker_len = len(self.sp.encode(self._marker))
        self._bytes: dict[int, bytes] = {}

    def default_id(self, name: str) -> int | None:
        found = {"bos": self.sp.bos_id(), "eos": self.sp.eos_id(), "pad": self.sp.pad_id()}[name]
        return found if found >= 0 else None

    def adds_bos(self, bos_id: int) -> bool:
        return True  # sentencepiece models (Llama 1/2, Mistral) are trained with BOS

    def closing_ids(self) -> list[int]:
        return []  # no post-processor

    @staticmethod
    def _splitter(tokens: dict[int, str]) -> re.Pattern[str] | None:
        texts = sorted({t for t in tokens.values() if t}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def token_to_id(self, text: str) -> int | None:
        if text in self.by_text:
            return self.by_text[text]
        i = self.sp.piece_to_id(text)
        return i if 0 <= i < self.sp_size and self.sp.id_to_piece(i) == text else None

    def encode(self, text: str, special: bool) -> list[int]:
        splitter = self._split_all if special else self._split_plain
        if splitter is None:
            return self._sp_encode(text)
        ids: list[int] = []
        pos = 0
        for match in splitter.finditer(text):
            ids += self._encode_segment(text[pos : match.start()], at_start=pos == 0)
            ids.append(self.by_text[match.group()])
            pos = match.end()
        ids += self._encode_segment(text[pos:], at_start=pos == 0)
        return ids

    def _encode_segment(self, text: str, at_start: bool) -> list[int]:
        if not text:
            return []
        if at_start or self.legacy or not self.dummy_prefix:
            return self._sp_encode(text)
        # sentencepiece cannot switch its dummy prefix off per call; encoding after a marker
        # whose ids are known and dropping them leaves the text unprefixed (transformers' trick).
        return self._sp_encode(self._marker + text)[self._marker_len :]

    def _sp_encode(self, text: str) -> list[int]:
        return [int(i) for i in self.sp.encode(text)]  # sentencepiece is untyped

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        out = bytearray()
        first = True
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size or (
                skip_special and token_id in self.special_ids
            ):
                continue
            chunk = self.token_bytes(token_id)
            # sentencepiece drops the dummy-prefix space of the first piece it prints.
            if first and self.dummy_prefix and chunk[:1] == b" " and token_id not in self.added:
                if not self.sp.is_byte(token_id):
                    chunk = chunk[1:]
            first = False
            out += chunk
        return out.decode("utf-8", errors=_PER_BYTE_REPLACE)

    def piece(self, token_id: int) -> str | None:
        if token_id in self.added:
            return self.added[token_id]
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.sp_size else None

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        if token_id in self.added:
            data = self.added[token_id].encode()
        elif not 0 <= token_id < self.sp_size:
            data = b""
        elif self.sp.is_byte(token_id):
            data = bytes([int(self.sp.id_to_piece(token_id)[3:5], 16)])
        else:
            data = self.sp.id_to_piece(token_id).replace(_SPACE_MARK, " ").encode()
        self._bytes[token_id] = data
        return data


class Tokenizer:
    """A model's tokenizer: encode/decode, special-token ids, token bytes and chat template.

    BOS: tokenizer_config `bos_token` when that key is present (null means "no BOS", as for
    Qwen), else config.json then generation_config.json `bos_token_id`, else the SentencePiece
    model's own; PAD likewise. EOS: the union of generation_config, config.json and
    tokenizer_config, in that order. `add_bos_default`: tokenizer_config `add_bos_token`, else
    whether tokenizer.json's post-processor adds BOS; True for SentencePiece.
    """

    def __init__(
        self,
        backend: _HFBackend | _SPBackend,
        tok_config: dict[str, Any],
        config: dict[str, Any],
        gen_config: dict[str, Any],
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._backend = backend
        self._closing_ids: list[int] | None = None  # encode_for_embedding's, when first asked
        self._max_token_bytes: int | None = None  # max_token_bytes, when first asked
        self.vocab_size: int = backend.vocab_size
        self.special_ids: frozenset[int] = frozenset(backend.special_ids)
        self.chat_template = chat_template

        def token_id(name: str) -> int | None:
            if f"{name}_token" in tok_config:
                text = _token_text(tok_config[f"{name}_token"])
                return None if text is None else backend.token_to_id(text)
            ids = _id_list(config.get(f"{name}_token_id"))
            ids = ids or _id_list(gen_config.get(f"{name}_token_id"))
            return ids[0] if ids else backend.default_id(name)

        self.bos_token_id = token_id("bos")
        self.pad_token_id = token_id("pad")
        eos = _id_list(gen_config.get("eos_token_id")) + _id_list(config.get("eos_token_id"))
        eos_text = _token_text(tok_config.get("eos_token"))
        named_eos = backend.token_to_id(eos_text) if eos_text is not None else None
        if named_eos is not None:
            eos.append(named_eos)
        found: list[int | None] = list(eos) or [backend.default_id("eos")]
        self.eos_token_ids: list[int] = [i for i in dict.fromkeys(found) if i is not None]
        add_bos = tok_config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = self.bos_token_id is not None and backend.adds_bos(self.bos_token_id)
        self.add_bos_default: bool = add_bos

        # The strings chat templates see as bos_token, eos_token, ... (transformers' names).
        self.special_tokens: dict[str, str] = {}
        fallback = {"bos": self.bos_token_id, "eos": next(iter(self.eos_token_ids), None)}
        for name in _NAMED_SPECIALS:
            text = _token_text(tok_config.get(f"{name}_token"))
            fallback_id = fallback.get(name)
            if f"{name}_token" not in tok_config and fallback_id is not None:
                text = backend.piece(fallback_id)
            if text is not None:
                self.special_tokens[f"{name}_token"] = text

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face model directory (tokenizer.json, else tokenizer.model)."""
        model_dir = Path(path)
        tokenizer_json = model_dir / "tokenizer.json"
        sp_model = model_dir / "tokenizer.model"
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        backend: _HFBackend | _SPBackend
        if tokenizer_json.is_file():
            try:
                backend = _HFBackend(tokenizer_json)
            except Exception as exc:  # the Rust side raises a bare Exception on bad files
                raise TokenizerError(f"{tokenizer_json}: cannot load ({exc})") from exc
        elif sp_model.is_file():
            try:
                backend = _SPBackend(sp_model, tok_config)
            except (OSError, RuntimeError) as exc:
                raise TokenizerError(f"{sp_model}: cannot load ({exc})") from exc
        else:
            raise TokenizerFilesNotFound(
                f"no tokenizer in {model_dir}: looked for tokenizer.json and tokenizer.model"
            )
        return cls(
            backend,
            tok_config,
            _read_json(model_dir / "config.json"),
            _read_json(model_dir / "generation_config.json"),
            load_chat_template(model_dir, tok_config),
        )

    def encode(self, text: str, *, add_bos: bool | None = True, special: bool = True) -> list[int]:
        """Token ids of `text`; `add_bos=None` means `add_bos_default`. Text that is not a
        string or holds a lone surrogate (a JSON "\\ud800" escape: not Unicode text) is a
        TokenizerError naming where, not a backend's TypeError."""
        if not isinstance(text, str):
            raise TokenizerError(f"can only encode text (str), got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(
                f"the text holds a lone surrogate {text[e.start]!r} at character {e.start}: "
                "it is not valid Unicode (an unpaired \\ud800-\\udfff escape?)"
            ) from None
        ids = self._backend.encode(text, special)
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_for_embedding(self, text: str) -> list[int]:
        """`text` framed as the model's tokenizer frames a bare call: BOS by default, and
        whatever special tokens its post-processor appends (an embedding model that pools
        its last token, as Qwen3-Embedding, is trained to end on one)."""
        if self._closing_ids is None:
            self._closing_ids = self._backend.closing_ids()
        return self.encode(text, add_bos=None) + self._closing_ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._backend.decode(ids, skip_special)

    def token_to_id(self, text: str) -> int | None:
        """The id of a single token given as its piece, or None."""
        return self._backend.token_to_id(text)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._backend.piece(token_id)
        if piece is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary")
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        return self._backend.token_bytes(token_id)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (at least 1): a text of B bytes has
        at least B / max_token_bytes tokens, which bounds a prompt before tokenizing it.
        Computed once (a pass over the vocabulary)."""
        if self._max_token_bytes is None:
            longest = max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)
            self._max_token_bytes = max(longest, 1)
        return self._max_token_bytes

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`; raises ChatTemplateError without a template."""
        return render_chat_template(
            select_template(self.chat_template, tools=tools),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            **extra,
        )


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas.

    Each step decodes a short window (the last chunk that produced text, plus the new ids) and
    emits what the window adds beyond that chunk's own text. Decoding from a token boundary
    rather than from scratch keeps every step O(new tokens) while letting the backend apply
    its own rules (byte fallback, SentencePiece's leading space) exactly as in a full decode.
    `context_ids` (e.g. the prompt) are decoded for context only, so the first new token gets
    the leading space it has after them.
    """

    _CONTEXT_TOKENS = 8

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids = list(context_ids[-self._CONTEXT_TOKENS :])
        self._prefix = 0  # window start: first id of the last text-producing chunk
        self._read = len(self._ids)  # ids before this are fully emitted
        self._prefix_text = self._decode(self._ids)
        self._held = 0  # characters already emitted beyond _read (before an incomplete tail)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special=self._skip_special)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        new = self._window_delta()
        if new.endswith("\ufffd"):
            # An incomplete UTF-8 sequence decodes to U+FFFD; hold it until its bytes arrive,
            # but release the complete characters before it.
            stable = new.rstrip("\ufffd")
            out = stable[self._held :]
            self._held = max(self._held, len(stable))
            return out
        return self._advance(new)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete tail decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._advance(self._window_delta())

    def _window_delta(self) -> str:
        text = self._decode(self._ids[self._prefix :])
        if text.startswith(self._prefix_text):
            return text[len(self._prefix_text) :]
        # Only reachable if the context ends inside a character; emit from where they differ.
        self._held = 0
        return text[len(os.path.commonprefix([text, self._prefix_text])) :]

    def _advance(self, new: str) -> str:
        out = new[self._held :]
        self._held = 0
        chunk_text = self._decode(self._ids[self._read :])
        if chunk_text:
            self._prefix, self._prefix_text = self._read, chunk_text
        else:
            # A chunk that decodes to nothing (skipped special tokens) cannot anchor the window:
            # the backend would strip the next token's leading space as if it began the text.
            self._prefix_text = self._decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        # Ids before the window are never decoded again.
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return out
