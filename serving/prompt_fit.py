"""A chat or a text fitted into the model's context window, as TGW does it: the prompt may
use the context (or TGW's `truncation_length`, when smaller) minus `max_new_tokens`, with
at least a quarter of the window kept for the prompt; a chat loses its oldest turns first
(its system message and last message stay), a text loses its beginning.
"""

from __future__ import annotations

from typing import Any

from loader.base import LoadedModel
from loader.errors import SamplingSettingsError
from loader.values import as_int

Message = dict[str, str]


def budget(model: LoadedModel, state: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens allowed, max_new_tokens) for this model and state: TGW's
    truncation_length (0: the model's context) minus max_new_tokens, with at least a
    quarter of the window kept for the prompt."""
    context = model.context_length
    truncation = _count(state, "truncation_length", 0, "0 (the model's context) or more")
    limit = min(truncation or context, context)
    new = min(_count(state, "max_new_tokens", 1, "1 or more"), limit - limit // 4)
    return limit - new, max(1, new)


def _count(state: dict[str, Any], key: str, minimum: int, expected: str) -> int:
    """A token count from the page: Gradio sends integral floats, an empty box None (the
    default, `minimum`). Anything else fails naming the key, not with int()'s message."""
    value = state.get(key)
    if value is None or value == "":
        return minimum
    try:
        count = as_int(key, value)
    except SamplingSettingsError:
        raise SamplingSettingsError(f"{key} must be a whole number, got {value!r}") from None
    if count < minimum:
        raise SamplingSettingsError(f"{key} must be {expected}, got {value!r}")
    return count


def fit_messages(model: LoadedModel, messages: list[Message], limit: int) -> list[Message]:
    """Drop the oldest turns (keeping a system message and the last message) until the
    templated prompt fits in `limit` tokens, as TGW's chat does."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system) :]
    while len(rest) > 1:
        prompt = model.apply_chat_template(system + rest, add_generation_prompt=True)
        if len(model.encode(prompt, add_bos=False)) <= limit:
            break
        rest = rest[1:]
    return system + rest
