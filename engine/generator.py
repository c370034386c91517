"""Streaming generation of one job over the engine.

`generate(engine, prompt_ids, settings)` yields `GenerationEvent`s: a text delta with the
token ids behind it, and on the last event the finish reason ("stop" for EOS, a stop token
or a stop string; "length" for max_new_tokens or a full context) and timings.

Stop strings are held back until they can no longer match (engine/stops.py), and the
incremental detokenizer holds back incomplete UTF-8, so every delta is final text.
This is the single-job path; the continuous-batching scheduler drives the same engine
forward with many sequences.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.sampling import Sampler
from engine.sampling_settings import SamplingSettings
from engine.stops import StopMatcher
from engine.tokenizer import IncrementalDecoder, Tokenizer


class DecodeSession(Protocol):
    """One sequence's state in a model: feed tokens, get the last token's logits [vocab]."""

    def prefill(self, token_ids: list[int]) -> torch.Tensor: ...
    def step(self, token_id: int) -> torch.Tensor: ...
    def close(self) -> None: ...


class GenerationBackend(Protocol):
    """What the generation loop needs of a model: the Kestrel engine and the transformers
    loader both provide it, so sampling and stop handling are the same code for both."""

    tokenizer: Tokenizer
    max_seq_len: int

    @property
    def logits_device(self) -> torch.device: ...
    def check_length(self, prompt_tokens: int, new_tokens: int = 0) -> None: ...
    def open_session(self) -> DecodeSession: ...


@dataclass
class GenerationEvent:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    generate_seconds: float = 0.0
    seed: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


def generate(
    engine: GenerationBackend,
    prompt_ids: list[int],
    settings: SamplingSettings | dict[str, Any] | None = None,
) -> Iterator[GenerationEvent]:
    settings = SamplingSettings.from_any(settings)
    engine.check_length(len(prompt_ids))
    max_new = min(settings.max_new_tokens, engine.max_seq_len - len(prompt_ids))
    device = engine.logits_device
    stop_ids = set(settings.stop_token_ids)
    if not settings.ban_eos_token:
        stop_ids |= set(engine.tokenizer.eos_token_ids)
    sampler = Sampler(settings, device=device, eos_token_ids=engine.tokenizer.eos_token_ids)
    decoder = IncrementalDecoder(
        engine.tokenizer, skip_special=settings.skip_special_tokens, context_ids=prompt_ids
    )
    stops = StopMatcher(settings.stop)
    context = torch.tensor(prompt_ids, dtype=torch.int64, device=device)
    session = engine.open_session()
    started = time.perf_counter()
    prompt_seconds = 0.0
    generated: list[int] = []

    def event(text: str, ids: list[int], reason: str | None = None) -> GenerationEvent:
        now = time.perf_counter()
        return GenerationEvent(
            text=text,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=len(prompt_ids),
            generated_tokens=len(generated),
            prompt_seconds=prompt_seconds,
            generate_seconds=now - started - prompt_seconds,
            seed=sampler.seed,
        )

    try:
        if max_new <= 0:
            yield event("", [], "length")
            return
        logits = session.prefill(prompt_ids)
        prompt_seconds = time.perf_counter() - started
        while True:
            token = sampler.sample(logits, context)
            generated.append(token)
            if token in stop_ids:
                yield event(decoder.flush() + stops.flush(), [token], "stop")
                return
            text, hit = stops.feed(decoder.add([token]))
            if hit:
                yield event(text, [token], "stop")
                return
            if len(generated) >= max_new:
                tail, _ = stops.feed(decoder.flush())
                yield event(text + tail + stops.flush(), [token], "length")
                return
            yield event(text, [token])
            context = torch.cat([context, context.new_tensor([token])])
            logits = session.step(token)
    finally:
        session.close()
