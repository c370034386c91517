"""What a job's settings ask to constrain its output to (engine/constraints/__init__.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import KestrelError

# Settings keys (in SamplingSettings.extra) -> the kind of constraint they ask for.
CONSTRAINT_KEYS = ("json_schema", "json_object", "regex", "lark", "grammar_string")
MAX_GRAMMAR_CHARS = 1 << 20  # a megabyte of grammar text is far beyond any real one


class ConstraintError(KestrelError, ValueError):
    """A schema or grammar that cannot be used; `param` names the settings key."""


@dataclass(frozen=True)
class ConstraintSpec:
    """kind: "json_schema" | "json_object" | "regex" | "lark" | "gbnf"; text: its source
    (a JSON schema as JSON text); param: the settings key it came from."""

    kind: str
    text: str
    param: str


def constraint_spec(settings: Any) -> ConstraintSpec | None:
    """The constraint `settings` (a SamplingSettings) ask for, or None."""
    extra = settings.extra
    asked = [key for key in CONSTRAINT_KEYS if _is_set(extra.get(key))]
    if len(asked) > 1:
        raise ConstraintError(
            f"only one constraint per request, got {', '.join(asked)}", param=asked[1]
        )
    if not asked:
        return None
    key = asked[0]
    value = extra[key]
    if key == "json_object":
        if value is not True:
            raise ConstraintError(f"json_object must be true or absent, got {value!r}", param=key)
        return ConstraintSpec("json_object", '{"type": "object"}', key)
    if key == "json_schema":
        return ConstraintSpec("json_schema", _schema_text(value, key), key)
    if not isinstance(value, str):
        raise ConstraintError(f"{key} must be a string, got {type(value).__name__}", param=key)
    _check_size(value, key)
    return ConstraintSpec("gbnf" if key == "grammar_string" else key, value, key)


def _is_set(value: Any) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, str) and not value.strip())


def _schema_text(value: Any, key: str) -> str:
    if isinstance(value, str):
        _check_size(value, key)
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ConstraintError(f"{key} is not valid JSON: {error}", param=key) from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise ConstraintError(
            f"{key} must be a JSON schema object, got {type(value).__name__}", param=key
        )
    text = json.dumps(value)
    _check_size(text, key)
    return text


def _check_size(text: str, key: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(
            f"{key} has {len(text)} characters, more than {MAX_GRAMMAR_CHARS}", param=key
        )
