"""Checking the regular expressions an adapter_config.json brings (rank_pattern,
alpha_pattern, a string target_modules) before anything matches them.

They come from downloaded files and Python's `re` holds the GIL while it matches: one
pattern such as `([a-z_.0-9]+)+!` backtracks exponentially on a module name and froze the
whole server for minutes. Exponential backtracking needs a repetition inside a repetition
(or an alternation under one: `(a|aa)+`); no real adapter's pattern has that shape (they
name modules: `model.layers.3.self_attn.q_proj`, `layers\\.\\d+\\.mlp`), so such patterns
are refused outright, as are very long ones. What is left matches a module name in time
polynomial in its length, which is short.
"""

from __future__ import annotations

import re
import re._constants as sre
import re._parser as sre_parse
from typing import Any

MAX_PATTERN_CHARS = 512
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT}


class UnsafePatternError(ValueError):
    """A pattern that is malformed, too long, or can backtrack exponentially."""


def check_pattern(pattern: str) -> None:
    """Raises UnsafePatternError (saying why) for a pattern that must not be matched."""
    if not isinstance(pattern, str):
        raise UnsafePatternError(f"pattern {pattern!r} is not a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise UnsafePatternError(
            f"pattern of {len(pattern)} characters (at most {MAX_PATTERN_CHARS})"
        )
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise UnsafePatternError(f"pattern {pattern[:100]!r} does not parse ({e})") from None
    if _nested_repeat(list(parsed), inside_repeat=False):
        raise UnsafePatternError(
            f"pattern {pattern[:100]!r} repeats a repetition or an alternation (such as "
            "'(a+)+'), which can take exponential time to match; name the modules plainly"
        )


def _nested_repeat(items: list[tuple[Any, Any]], inside_repeat: bool) -> bool:
    for op, arg in items:
        if op in _REPEATS:
            low, high, body = arg
            unbounded = high == sre.MAXREPEAT or high > 1
            if inside_repeat and unbounded:
                return True
            if _nested_repeat(list(body), inside_repeat or unbounded):
                return True
        elif op == sre.BRANCH:
            if inside_repeat:
                return True
            if any(_nested_repeat(list(branch), inside_repeat) for branch in arg[1]):
                return True
        elif op == sre.SUBPATTERN:
            if _nested_repeat(list(arg[3]), inside_repeat):
                return True
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            if _nested_repeat(list(arg[1]), inside_repeat):
                return True
        elif op == sre.ATOMIC_GROUP:
            if _nested_repeat(list(arg), inside_repeat):
                return True
    return False
