"""Streaming one job: `generate(backend, prompt_ids, settings)` yields `GenerationEvent`s.

A backend with a `scheduler` (the Kestrel engine) runs the job there, batched with
whatever else is running (engine/scheduler.py); any other backend (the transformers
loader) runs the single-job loop `generate_single` over a `DecodeSession`. Both use the
per-job pieces of engine/generator.py (sampler, output processor), so they emit the same
tokens. The single-job loop rewinds for a banned string by computing the kept tokens
again in a fresh session; the scheduler trims the job's cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from engine.generator import (
    GenerationEvent,
    JobSampler,
    OutputProcessor,
    PositionBans,
    TokenLogprob,
    sample_jobs,
)
from engine.sampling_settings import SamplingSettings
from engine.tokenizer import Tokenizer


class DecodeSession(Protocol):
    """One sequence's state in a model: feed tokens, get the last token's logits [vocab]."""

    def prefill(self, token_ids: list[int]) -> torch.Tensor: ...
    def step(self, token_id: int) -> torch.Tensor: ...
    def close(self) -> None: ...


class GenerationBackend(Protocol):
    """What the generation loop needs of a model: the Kestrel engine and the transformers
    loader both provide it, so sampling and stop handling are the same code for both.
    A backend may also have a `scheduler` (engine.scheduler.Scheduler): `generate` then
    submits the job there instead of opening a session."""

    tokenizer: Tokenizer
    max_seq_len: int

    @property
    def logits_device(self) -> torch.device: ...
    def check_length(self, prompt_tokens: int, new_tokens: int = 0) -> None: ...
    def open_session(self) -> DecodeSession: ...


def generate(
    backend: GenerationBackend,
    prompt_ids: list[int],
    settings: SamplingSettings | Mapping[str, Any] | None = None,
) -> Iterator[GenerationEvent]:
    """Stream one job: on the backend's scheduler if it has one, else on a session."""
    scheduler = getattr(backend, "scheduler", None)
    if scheduler is None:
        yield from generate_single(backend, prompt_ids, settings)
        return
    job = scheduler.submit(prompt_ids, settings)
    yield from scheduler.stream(job)


def generate_single(
    backend: GenerationBackend,
    prompt_ids: list[int],
    settings: SamplingSettings | Mapping[str, Any] | None = None,
) -> Iterator[GenerationEvent]:
    """The single-job loop over a `DecodeSession` (no batching, no prefix cache)."""
    settings = SamplingSettings.from_any(settings)
    backend.check_length(len(prompt_ids))
    max_new = min(settings.max_new_tokens, backend.max_seq_len - len(prompt_ids))
    tokenizer = backend.tokenizer
    sampling = JobSampler(settings, tokenizer, backend.logits_device, prompt_ids, max_new)
    output = OutputProcessor(tokenizer, prompt_ids, settings, max_new)
    session = backend.open_session()
    started = time.perf_counter()
    prompt_seconds = 0.0

    def event(text: str, ids: list[int], reason: str | None, lp: Any = None) -> GenerationEvent:
        now = time.perf_counter()
        return GenerationEvent(
            text=text,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=len(prompt_ids),
            generated_tokens=len(output.generated),
            prompt_seconds=prompt_seconds,
            generate_seconds=now - started - prompt_seconds,
            seed=sampling.seed,
            logprobs=lp,
        )

    bans = PositionBans()
    lps: list[TokenLogprob | None] = []  # per generated token, until it is emitted
    try:
        if max_new <= 0:
            yield event("", [], "length")
            return
        logits = session.prefill(prompt_ids)
        prompt_seconds = time.perf_counter() - started
        while True:
            position = len(output.generated)
            ban = bans.at(position)
            tokens, logprobs = sample_jobs([sampling], logits.unsqueeze(0), [ban] if ban else None)
            token = tokens[0]
            lps.append(logprobs[0][0] if logprobs[0] else None)
            fed = output.feed_token(token)
            if fed.rewind is not None:
                # A banned string: this loop has no cache to trim, so it computes the kept
                # tokens again in a fresh session (rewinds are rare).
                bans.rewind(fed.rewind, fed.banned_token)
                del lps[fed.rewind :]
                sampling.truncate(len(prompt_ids) + fed.rewind)
                session.close()
                session = backend.open_session()
                logits = session.prefill(prompt_ids + output.generated)
                continue
            start = output.final - len(fed.token_ids)
            held_lps = lps[start : output.final]
            lp = [x for x in held_lps if x is not None] if sampling.logprobs_k is not None else None
            yield event(fed.text, fed.token_ids, fed.finish_reason, lp)
            if fed.finish_reason is not None:
                return
            logits = session.step(token)
    finally:
        session.close()
