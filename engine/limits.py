"""The context limit a prompt is checked against, and the errors for breaking it (the
engine, the scheduler and the transformers loader share them)."""

from __future__ import annotations

from engine.errors import KestrelError


class ContextLengthError(KestrelError, ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


class EmptyPromptError(ContextLengthError):
    """A prompt without a single token."""


def check_length(prompt_tokens: int, new_tokens: int, max_seq_len: int) -> None:
    """Raise unless a prompt of `prompt_tokens` plus `new_tokens` fits `max_seq_len`."""
    if prompt_tokens == 0:
        raise EmptyPromptError("the prompt is empty: at least one token is needed")
    if prompt_tokens + new_tokens > max_seq_len:
        raise ContextLengthError(
            f"the prompt has {prompt_tokens} tokens"
            + (f" and {new_tokens} new tokens were asked for" if new_tokens else "")
            + f"; the context holds {max_seq_len} (max_seq_len)"
        )
