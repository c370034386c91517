"""TGW's `modules.text_generation`: encode, decode and generate_reply on the current model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from serving import shared as _shared
from serving import text_generation as _generation


def encode(
    prompt: str,
    add_special_tokens: bool = True,
    add_bos_token: bool = True,
    truncation_length: int | None = None,
) -> torch.Tensor:
    """Token ids as a [1, n] int64 tensor, as TGW returns them."""
    ids = _shared.manager.current().encode(str(prompt), add_bos=add_bos_token)
    if truncation_length is not None:
        ids = ids[-truncation_length:]
    return torch.tensor([ids], dtype=torch.int64)


def decode(output_ids: Any, skip_special_tokens: bool = True) -> str:
    if isinstance(output_ids, torch.Tensor):
        output_ids = output_ids.reshape(-1).tolist()
    return _shared.manager.current().decode(list(output_ids))


def generate_reply(
    question: str,
    state: dict[str, Any],
    stopping_strings: list[str] | None = None,
    is_chat: bool = False,
    escape_html: bool = False,
    for_ui: bool = False,
) -> Iterator[str]:
    state = dict(state)
    if stopping_strings:
        state["stopping_strings"] = list(stopping_strings)
    yield from _generation.generate_reply(question, state, is_chat=is_chat)
