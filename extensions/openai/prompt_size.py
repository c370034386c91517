"""Refusing prompts that cannot fit the context by their size alone, before tokenizing.

A text of B bytes has at least B / max_token_bytes tokens (engine/tokenizer.py); when even
that is more than the context, tokenizing it (seconds for megabytes) would only end in the
same "context length exceeded" 400. The bound is taken with a factor 2 of slack, so a
tokenizer whose normalizer drops characters is never refused a prompt that would fit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from extensions.openai.errors import ApiError
from loader.base import LoadedModel

SLACK = 2


async def check_prompt_size(model: LoadedModel, texts: Iterable[str], param: str) -> None:
    """A 400 (context_length_exceeded) for the first text too large to fit the context."""
    texts = [t for t in texts if isinstance(t, str)]
    if not texts:
        return
    # The first call walks the vocabulary once: off the event loop.
    per_token = await asyncio.to_thread(lambda: model.max_token_bytes)
    context = model.context_length
    limit = context * per_token * SLACK
    for text in texts:
        # len(text) characters are at least len(text) bytes: no need to encode short ones.
        if len(text) <= limit // 4:
            continue
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise ApiError(
                400,
                f"{param} is {size} bytes: at least {size // per_token} tokens (a token of this "
                f"model is at most {per_token} bytes), more than the context holds ({context} "
                "tokens); it was refused without tokenizing",
                param=param,
                code="context_length_exceeded",
            )
