"""Logprobs in OpenAI's two shapes: the legacy completions object (tokens, token_logprobs,
top_logprobs, text_offset) and the chat `content` list (token, logprob, bytes,
top_logprobs). Token strings are the token's bytes decoded as UTF-8 (a token that splits a
character shows U+FFFD; `bytes` in chat has the exact bytes)."""

from __future__ import annotations

from typing import Any

import torch

from loader.base import LoadedModel
from loader.values import Tokenizer, TokenLogprob


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


class CompletionLogprobs:
    """Accumulates the legacy completions logprobs object of one choice."""

    def __init__(self, tokenizer: Tokenizer, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """Adds entries; returns the object for just these (a streamed chunk's)."""
        part = CompletionLogprobs(self.tokenizer, self.offset)
        for entry in entries:
            text = token_text(self.tokenizer, entry.token_id)
            top = {token_text(self.tokenizer, i): lp for i, lp in entry.top}
            for target in (self, part):
                target.tokens.append(text)
                target.token_logprobs.append(entry.logprob)
                target.top_logprobs.append(top)
                target.text_offset.append(self.offset)
            self.offset += len(text)
            part.offset = self.offset
        return part.as_dict()

    def add_prompt(self, ids: list[int], logprobs: list[TokenLogprob | None]) -> None:
        for token_id, entry in zip(ids, logprobs, strict=True):
            text = token_text(self.tokenizer, token_id)
            self.tokens.append(text)
            self.token_logprobs.append(None if entry is None else entry.logprob)
            self.top_logprobs.append(
                None
                if entry is None
                else {token_text(self.tokenizer, i): lp for i, lp in entry.top}
            )
            self.text_offset.append(self.offset)
            self.offset += len(text)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """The chat `logprobs.content` items for these entries."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            "logprob": logprob,
            "bytes": list(raw),
        }

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
        for e in entries
    ]


def prompt_logprobs(model: LoadedModel, ids: list[int], k: int) -> list[TokenLogprob | None]:
    """Per prompt token, its logprob given the tokens before it (None for the first), with
    the k most likely tokens at that position: what `echo` with `logprobs` reports."""
    if len(ids) < 2:
        return [None] * len(ids)
    logp = torch.log_softmax(model.logits(ids[:-1]).float(), dim=-1)  # [L-1, V]
    targets = torch.tensor(ids[1:], dtype=torch.int64).view(-1, 1)
    chosen = logp.gather(1, targets).squeeze(1).tolist()
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    values, indices = top.values.tolist(), top.indices.tolist()
    out: list[TokenLogprob | None] = [None]
    for t in range(len(ids) - 1):
        out.append(
            TokenLogprob(ids[t + 1], chosen[t], list(zip(indices[t], values[t], strict=True)))
        )
    return out
