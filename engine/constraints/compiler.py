"""Schemas and grammars -> llguidance matchers over a model's tokenizer.

llguidance needs the vocabulary as bytes per token (`Tokenizer.token_bytes`, which covers
tokenizer.json and SentencePiece alike) and an encoder for the text it forces; building
that table takes ~0.3 s for 49k tokens and ~1 s for 128k, so it is made once per tokenizer
and logits width. A compiled grammar is kept per (tokenizer, spec) and each job gets a copy
of its matcher (`deep_copy`): n choices of one request compile once.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Literal

import llguidance

from engine.constraints.spec import ConstraintError, ConstraintSpec
from engine.constraints.state import JobConstraint

# The grammar kinds llguidance.grammar_from reads.
GrammarFormat = Literal[
    "lark",
    "gbnf",
    "ebnf",
    "cfg",
    "grammar",
    "json_schema",
    "json",
    "regex",
    "choice",
    "llguidance",
]
_LLG_FORMAT: dict[str, GrammarFormat] = {
    "json_schema": "json_schema",
    "json_object": "json_schema",
    "regex": "regex",
    "lark": "lark",
    "gbnf": "gbnf",
}
_CACHED_GRAMMARS = 64

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_grammars: weakref.WeakKeyDictionary[
    Any, OrderedDict[tuple[str, str, int], llguidance.LLMatcher]
] = weakref.WeakKeyDictionary()


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        size = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(size)] + [b""] * max(0, vocab - size)
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        self.bos_token_id = tokenizer.bos_token_id
        # BOS/EOS are special even where tokenizer.json does not say so (a word-level
        # vocabulary): their text must never count as output text.
        named = [tokenizer.bos_token_id, *tokenizer.eos_token_ids]
        self.special_token_ids = sorted(
            set(tokenizer.special_ids) | {i for i in named if i is not None}
        )
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode()
        ids: list[int] = self._tokenizer.encode(
            data.decode("utf-8", errors="replace"), add_bos=False, special=False
        )
        # llguidance forces the tokens of text the grammar dictates: an encoding that does
        # not spell the text (an unknown word's unk token) must not be forced.
        if b"".join(self.tokens[i] for i in ids if 0 <= i < len(self.tokens)) != data:
            return []
        return ids


def ll_tokenizer(tokenizer: Any, vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` with `vocab` logits per row (made once)."""
    with _lock:
        per_vocab = _tokenizers.setdefault(tokenizer, {})
        if vocab not in per_vocab:
            wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab))
            eos = list(tokenizer.eos_token_ids) or None
            per_vocab[vocab] = llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=eos)
        return per_vocab[vocab]


def compile_constraint(
    spec: ConstraintSpec, tokenizer: Any, vocab: int, stop_ids: frozenset[int] = frozenset()
) -> JobConstraint:
    """A job's matcher for `spec`; ConstraintError (naming spec.param) when it is wrong.
    `stop_ids`: tokens that end the job (EOS, stop tokens), never fed to the matcher."""
    ll_tok = ll_tokenizer(tokenizer, vocab)
    key = (spec.kind, spec.text, vocab)
    with _lock:
        cache = _grammars.setdefault(tokenizer, OrderedDict())
        prototype = cache.get(key)
        if prototype is not None:
            cache.move_to_end(key)
    if prototype is None:
        prototype = _compile(spec, ll_tok)
        with _lock:
            cache[key] = prototype
            while len(cache) > _CACHED_GRAMMARS:
                cache.popitem(last=False)
    return JobConstraint(prototype.deep_copy(), spec, ll_tok, stop_ids)


def check_constraint(spec: ConstraintSpec) -> None:
    """ConstraintError (naming spec.param and where the text is wrong) for a schema or
    grammar that cannot compile; needs no model, so front ends check before they submit."""
    _grammar(spec, None)


def _grammar(spec: ConstraintSpec, ll_tok: llguidance.LLTokenizer | None) -> str:
    what = {"gbnf": "grammar", "lark": "Lark grammar", "regex": "regex"}.get(spec.kind, "schema")
    try:
        if spec.kind in ("json_schema", "json_object"):
            # Compact JSON ({"a": 1, "b": 2}): free whitespace lets a model spend its tokens
            # on newlines (a schema's own x-guidance options still win).
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                spec.text, defaults={"whitespace_flexible": False}
            )
        else:
            grammar = llguidance.grammar_from(_LLG_FORMAT[spec.kind], spec.text)
    except ValueError as error:
        raise ConstraintError(f"{spec.param}: invalid {what}: {error}", param=spec.param) from None
    message = llguidance.LLMatcher.validate_grammar(grammar, ll_tok)
    if message:
        raise ConstraintError(f"{spec.param}: invalid {what}: {message.strip()}", param=spec.param)
    return grammar


def _compile(spec: ConstraintSpec, ll_tok: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    grammar = _grammar(spec, ll_tok)
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"{spec.param}: {matcher.get_error()}", param=spec.param)
    return matcher
