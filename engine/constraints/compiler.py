"""Schemas and grammars -> llguidance matchers over a model's tokenizer.

llguidance needs the vocabulary as bytes per token (`Tokenizer.token_bytes`, which covers
tokenizer.json and SentencePiece alike) and an encoder for the text it forces; building
that table takes ~0.3 s for 49k tokens and ~1 s for 128k, so it is made once per tokenizer
and logits width. A compiled grammar is kept per (tokenizer, spec) and each job gets a copy
of its matcher (`deep_copy`): n choices of one request compile once.

Lanes: llguidance's `deep_copy` is shallow where it matters. Every copy shares the
prototype's lexer (its lazily built automaton, a cache worth keeping warm) behind one
mutex, held for a whole mask. Jobs copied from one prototype therefore compute their masks
one at a time whatever the threads. So a grammar gets one prototype per mask lane
(engine/constraints/lanes.py), each with its own lexer, made when a job first needs it. A
new job goes to the least busy lane (whatever its grammar), or to one where its grammar
already has a lexer if that is at most one job busier: masks of different lanes run in
parallel, the jobs of one grammar in one lane share a warm lexer, and a grammar that runs
one job at a time keeps one lexer.

Slices: llguidance skips walking the token trie for a "slice" of tokens (e.g. JSON string
bodies of 1-10 characters) when the lexer allows all of them. Its default slices stop at
10, 30 and unbounded lengths, so inside a string with `maxLength` and fewer than 10
characters left every mask walks the whole 128k trie (~0.5-1 ms). Finer length steps let
those masks take most tokens wholesale; the masks are the same (tests/engine/test_constraints.py
compares them).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Literal

import llguidance

from engine.constraints.lanes import mask_lanes
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
# Prototype matchers (lexers, ~2 MiB each once warm) kept over all cached grammars of one
# tokenizer: without it 64 grammars x a dozen lanes could hold ~1.5 GiB. The least
# recently used grammars go first; running jobs keep their own copies either way.
_CACHED_LEXERS = 96
# A JSON string's characters (no quote, backslash or control character), as llguidance's
# own slices write them, in length steps fine enough for typical maxLength bounds.
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
SLICES = [
    r"[\x20\x0A\x0D\x09]+",
    *(f"{_STRING_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 30)),
    f"{_STRING_CHAR}+",
]

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_grammars: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, str, int], _Compiled]] = (
    weakref.WeakKeyDictionary()
)


# Live jobs per lane, whatever their grammar (decremented when a job's constraint is
# freed). A heuristic for balance only: a count that is off by one moves a job to
# another lane, never breaks one.
_lane_jobs: list[int] = []


def _release(lane: int) -> None:
    # Runs wherever the constraint is freed (a finalizer): no lock, which it could find
    # held by its own thread.
    if lane < len(_lane_jobs):
        _lane_jobs[lane] = max(0, _lane_jobs[lane] - 1)


class _Compiled:
    """A checked grammar and its prototype matchers, one per lane it was given (each a
    lexer: ~2 MiB once warm on the bench's schema with Llama-3's vocabulary)."""

    def __init__(self, grammar: str, first: llguidance.LLMatcher) -> None:
        self.grammar = grammar
        self.lanes: dict[int, llguidance.LLMatcher] = {}
        self.first: llguidance.LLMatcher | None = first  # the checked one: the first lane's

    @property
    def lexers(self) -> int:
        return len(self.lanes) + (self.first is not None)

    def next_job(self, ll_tok: llguidance.LLTokenizer) -> tuple[llguidance.LLMatcher, int]:
        """A new job's matcher (a copy of its lane's prototype) and its lane: the least
        busy lane, unless one this grammar already has a lexer in is busy by at most one
        job more (a warm lexer, no new one). Jobs of one grammar thus spread over the
        lanes as they run side by side, and a grammar run one job at a time keeps one."""
        count = mask_lanes()
        if len(_lane_jobs) < count:
            _lane_jobs.extend([0] * (count - len(_lane_jobs)))
        lane = min(range(count), key=_lane_jobs.__getitem__)
        own = [n for n in self.lanes if n < count]
        if own:
            mine = min(own, key=_lane_jobs.__getitem__)
            if _lane_jobs[mine] <= _lane_jobs[lane] + 1:
                lane = mine
        prototype = self.lanes.get(lane)
        if prototype is None:
            if self.first is not None:
                prototype, self.first = self.first, None
            else:
                prototype = llguidance.LLMatcher(ll_tok, self.grammar, log_level=0)
            self.lanes[lane] = prototype
        _lane_jobs[lane] += 1
        return prototype.deep_copy(), lane


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
            per_vocab[vocab] = llguidance.LLTokenizer(
                wrapper, n_vocab=vocab, eos_token=eos, slices=SLICES
            )
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
        compiled = cache.get(key)
        if compiled is not None:
            cache.move_to_end(key)
    if compiled is None:
        grammar = _grammar(spec, ll_tok)
        compiled = _Compiled(grammar, _matcher(spec, ll_tok, grammar))
        with _lock:
            compiled = cache.setdefault(key, compiled)
    with _lock:
        matcher, lane = compiled.next_job(ll_tok)
        _trim(cache)
    constraint = JobConstraint(matcher, spec, ll_tok, stop_ids, lane)
    weakref.finalize(constraint, _release, lane)
    return constraint


def _trim(cache: OrderedDict[tuple[str, str, int], _Compiled]) -> None:
    """Drop the least recently used grammars while the cache holds more than
    _CACHED_GRAMMARS of them or _CACHED_LEXERS lexers; the most recent one always stays."""
    lexers = sum(compiled.lexers for compiled in cache.values())
    while len(cache) > 1 and (len(cache) > _CACHED_GRAMMARS or lexers > _CACHED_LEXERS):
        _, dropped = cache.popitem(last=False)
        lexers -= dropped.lexers


def cached_lexers(tokenizer: Any) -> int:
    """Prototype matchers (lexers) cached for `tokenizer`'s grammars."""
    with _lock:
        return sum(compiled.lexers for compiled in _grammars.get(tokenizer, {}).values())


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


def _matcher(
    spec: ConstraintSpec, ll_tok: llguidance.LLTokenizer, grammar: str
) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"{spec.param}: {matcher.get_error()}", param=spec.param)
    return matcher
