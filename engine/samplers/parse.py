"""Value checks and TGW string forms behind `engine.sampling_settings` (no torch).

Every failure raises `SamplingSettingsError` with the key and the value as given, so a
user sees which setting to fix. Integer fields accept integral floats (Gradio numbers
arrive as `-1.0`); booleans are never taken for numbers.
"""

from __future__ import annotations

import ast
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

from engine.errors import KestrelError

# OpenAI's documented range for logit_bias: beyond it a bias only bans or forces a token.
MAX_BIAS = 100.0
# A stop or banned string is matched against the text after every token.
MAX_STRINGS = 256
MAX_STRING_CHARS = 1000


class SamplingSettingsError(KestrelError, ValueError):
    """A sampling setting has a value of the wrong type or out of range."""


def as_int(name: str, value: Any) -> int:
    # bool first: it is a numbers.Integral, and True is not a count.
    if not isinstance(value, bool):
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            number = float(value)
            if math.isfinite(number) and number.is_integer():
                return int(number)
    raise SamplingSettingsError(f"{name} must be an integer, got {value!r}", param=name)


def as_float(name: str, value: Any) -> float:
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number):
            return number
    raise SamplingSettingsError(f"{name} must be a finite number, got {value!r}", param=name)


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SamplingSettingsError(f"{name} must be True or False, got {value!r}", param=name)


def check_range(name: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise SamplingSettingsError(f"{name} must be {expected}, got {value!r}", param=name)


def as_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise SamplingSettingsError(f"{name} must be a list of strings, got {value!r}", param=name)


def check_strings(name: str, strings: list[str]) -> list[str]:
    """`strings` if there are at most MAX_STRINGS of at most MAX_STRING_CHARS each."""
    if len(strings) > MAX_STRINGS:
        raise SamplingSettingsError(
            f"{name} takes at most {MAX_STRINGS} strings, got {len(strings)}", param=name
        )
    for i, text in enumerate(strings):
        if len(text) > MAX_STRING_CHARS:
            raise SamplingSettingsError(
                f"{name} strings are at most {MAX_STRING_CHARS} characters, got "
                f"{len(text)} in string {i} ({text[:40]!r}...)",
                param=name,
            )
    return strings


def as_token_ids(name: str, value: Any) -> list[int]:
    """A list of token ids (ints >= 0). TGW's comma-separated string form ("1, 2") too,
    as `custom_token_bans` stores it."""
    items: Any = value
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
        try:
            items = [int(part) for part in items]
        except ValueError:
            items = None
    if isinstance(items, (list, tuple)):
        try:
            ids = [as_int(name, v) for v in items]
        except SamplingSettingsError:
            ids = None
        if ids is not None and all(i >= 0 for i in ids):
            return ids
    raise SamplingSettingsError(
        f"{name} must be a list of token ids (ints >= 0), got {value!r}", param=name
    )


def parse_stop(key: str, value: Any) -> list[str]:
    """Stop strings from `stop` (one string or a list) or TGW's `custom_stopping_strings`."""
    if value is None:
        return []
    if isinstance(value, str):
        if key != "custom_stopping_strings":
            return [value]
        # TGW's own parsing of the text box: a comma-separated list of Python string
        # literals, with escapes such as \n written out.
        try:
            parsed = ast.literal_eval(f"[{value}]")
        except (ValueError, SyntaxError, RecursionError, MemoryError) as e:
            raise SamplingSettingsError(
                f'{key} must look like \'"\\n", "User:"\', got {value!r} ({e})', param=key
            ) from None
        return as_str_list(key, parsed)
    return as_str_list(key, value)


def parse_sequence_breakers(name: str, value: Any) -> list[str]:
    """DRY's sequence breakers: TGW's JSON string list, with or without the brackets
    ('"\\n", ":"' or '["\\n", ":"]'), or a list of strings."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            parsed = json.loads(text if text.startswith("[") else f"[{text}]")
        except (json.JSONDecodeError, RecursionError) as e:  # nested past the stack's depth
            raise SamplingSettingsError(
                f'{name} must be JSON strings like \'"\\n", ":"\', got {value!r} ({e})', param=name
            ) from None
        value_list: Any = parsed
    else:
        value_list = value
    if isinstance(value_list, (list, tuple)) and all(isinstance(s, str) and s for s in value_list):
        return list(value_list)
    raise SamplingSettingsError(
        f"{name} must be a list of non-empty strings, got {value!r}", param=name
    )


def parse_logit_bias(name: str, value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token id (int, or its decimal string as JSON keys are) to a
    finite bias added to that token's logit."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out: dict[int, float] = {}
        for key, bias in value.items():
            token = _token_key(key)
            if (
                token is None
                or isinstance(bias, bool)
                or not isinstance(bias, numbers.Real)
                or not -MAX_BIAS <= float(bias) <= MAX_BIAS  # NaN fails this too
            ):
                raise SamplingSettingsError(
                    f"{name} must map token ids (>= 0) to numbers in [-{MAX_BIAS:g}, "
                    f"{MAX_BIAS:g}] (ban a token with custom_token_bans): {key!r}: {bias!r} "
                    f"is not, got {value!r}",
                    param=name,
                )
            out[token] = float(bias)
        return out
    raise SamplingSettingsError(
        f"{name} must map token ids (>= 0) to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
        f"got {value!r}",
        param=name,
    )


def parse_loras(name: str, value: Any, max_scale: float = math.inf) -> dict[str, float] | None:
    """A request's LoRA selection: None (the model's), {name: finite scale of at most
    `max_scale` in size}, or a list of names (scale 1 each)."""
    if value is None:
        return None
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return dict.fromkeys(value, 1.0)
    if isinstance(value, Mapping):
        out: dict[str, float] = {}
        for key, scale in value.items():
            if not isinstance(key, str) or not key:
                break
            out[key] = as_float(f"{name}['{key}']", scale)
            check_range(
                f"{name}['{key}']",
                scale,
                abs(out[key]) <= max_scale,
                f"at most {max_scale:g} in size",
            )
        else:
            return out
    raise SamplingSettingsError(
        f"{name} must map adapter names to finite scales (or list names), got {value!r}", param=name
    )


def _token_key(key: Any) -> int | None:
    if isinstance(key, str):
        key = key.strip()
        if not key.isdigit():
            return None
        return int(key)
    if not isinstance(key, bool) and isinstance(key, numbers.Integral) and int(key) >= 0:
        return int(key)
    return None
