"""Streaming generation: events, per-job output processing, and `generate()`.

`generate(backend, prompt_ids, settings)` yields `GenerationEvent`s: a text delta with the
token ids behind it (and their logprobs when asked for), timings on every event, and on
the last one the finish reason ("stop" for EOS, a stop token or a stop string; "length" for
max_new_tokens or a full context; "cancelled"; "error", the stream then raising).

A backend with a `scheduler` (the Kestrel engine) runs the job there, batched with
whatever else is running (engine/scheduler.py); any other backend (the transformers
loader) runs the single-job loop `generate_single` over a `DecodeSession`.

Both paths share the per-job pieces. `JobSampler` + `sample_jobs`: each job's own
`Sampler` (its seed, its state) and context, plain greedy rows argmax-ed together, one host
sync per batch. `OutputProcessor`: stop token ids, then the incremental detokenizer (which
holds back incomplete UTF-8), then the stop-string matcher (which holds back text that may
still become a stop string, engine/stops.py). So every delta is final text, a stop string
never reaches the stream, and the two paths emit the same events for the same tokens.

Logprobs: the settings key `logprobs` (an int k >= 0, in `SamplingSettings.extra`) adds,
per token, its log-probability under the model's raw distribution (log_softmax of the
logits, before penalties and temperature, as OpenAI reports them) and the k most likely
tokens with theirs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.sampling import Sampler
from engine.sampling_settings import SamplingSettings, SamplingSettingsError
from engine.stops import StopMatcher
from engine.tokenizer import IncrementalDecoder, Tokenizer


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


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), best first


@dataclass
class GenerationEvent:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0  # prefill: first scheduled until the first token
    generate_seconds: float = 0.0  # decode: the first token until this event
    seed: int | None = None
    job_id: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_seconds: float = 0.0  # submitted until first scheduled

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


def requested_logprobs(settings: SamplingSettings) -> int | None:
    """How many top logprobs the settings ask for per token; None: no logprobs."""
    value = settings.extra.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:  # OpenAI chat style: logprobs=True, top_logprobs=k
        value = settings.extra.get("top_logprobs") or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SamplingSettingsError(f"logprobs must be an integer >= 0, got {value!r}")
    return value


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V], tokens [N] -> (chosen [N], top values [N, k], top ids [N, k])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1)
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return chosen, top.values, top.indices


def logprob_entries(
    tokens: list[int], chosen: list[float], values: list[list[float]], ids: list[list[int]]
) -> list[TokenLogprob]:
    return [
        TokenLogprob(t, c, list(zip(i, v, strict=True)))
        for t, c, v, i in zip(tokens, chosen, values, ids, strict=True)
    ]


def plain_greedy(sampler: Sampler) -> bool:
    """Whether the sampler takes the argmax of the raw logits (no bias, ban or penalty).
    Unknown sampler internals count as not plain: that only costs the batched fast path."""
    s = sampler.settings
    return (
        s.greedy
        and not getattr(sampler, "steps", ("?",))
        and not s.logit_bias
        and not s.custom_token_bans
        and not s.ban_eos_token
        and s.min_new_tokens == 0
    )


class JobSampler:
    """One job's `Sampler`, the context it looks at (prompt + generated, kept on the
    device) and its logprobs request."""

    def __init__(
        self,
        settings: SamplingSettings,
        tokenizer: Tokenizer,
        device: torch.device,
        prompt_ids: list[int],
        max_new_tokens: int,
    ) -> None:
        self.sampler = Sampler(
            settings,
            device=device,
            eos_token_ids=tokenizer.eos_token_ids,
            encode=lambda text: tokenizer.encode(text, add_bos=False),
        )
        self.logprobs_k = requested_logprobs(settings)
        self.plain_greedy = plain_greedy(self.sampler)
        self._prompt = prompt_ids
        self._capacity = len(prompt_ids) + max_new_tokens
        self._context: torch.Tensor | None = None
        self._length = len(prompt_ids)

    @property
    def seed(self) -> int:
        return self.sampler.seed

    def context(self) -> torch.Tensor:
        """[1, L] int64 on the sampler's device; made on first use (plain greedy never asks)."""
        if self._context is None:
            buf = torch.full((self._capacity,), -1, dtype=torch.int64)
            buf[: len(self._prompt)] = torch.tensor(self._prompt, dtype=torch.int64)
            self._context = buf.to(self.sampler.device)
        return self._context[: self._length].view(1, -1)

    def append(self, token: torch.Tensor) -> None:
        """Add a sampled token ([1], on the device) to the context, without a host sync."""
        if self._context is not None:
            self._context[self._length : self._length + 1] = token
        self._length += 1


def sample_jobs(
    jobs: list[JobSampler], logits: torch.Tensor
) -> tuple[list[int], list[list[TokenLogprob] | None]]:
    """One token per row of logits [N, V], row i drawn by jobs[i]; with logprobs where asked.

    Plain greedy rows are argmax-ed together; each other row goes through its own sampler
    (its seed, its state). One host sync for the whole batch."""
    device = logits.device
    plain = [i for i, job in enumerate(jobs) if job.plain_greedy]
    if len(plain) == len(jobs):
        out = logits.argmax(dim=-1)
    else:
        out = torch.empty(len(jobs), dtype=torch.int64, device=device)
        if plain:
            index = torch.tensor(plain, device=device)
            out[index] = logits[index].argmax(dim=-1)
        for i, job in enumerate(jobs):
            if not job.plain_greedy:
                out[i : i + 1] = job.sampler.sample_batch(logits[i : i + 1], job.context())
    for i, job in enumerate(jobs):
        job.append(out[i : i + 1])
    want = [i for i, job in enumerate(jobs) if job.logprobs_k is not None]
    if want:
        k = max(jobs[i].logprobs_k or 0 for i in want)
        index = torch.tensor(want, device=device)
        chosen, values, ids = token_logprobs(logits[index], out[index], k)
    tokens = out.tolist()
    logprobs: list[list[TokenLogprob] | None] = [None] * len(jobs)
    if want:
        chosen_l, values_l, ids_l = chosen.tolist(), values.tolist(), ids.tolist()
        for n, i in enumerate(want):
            k = jobs[i].logprobs_k or 0
            logprobs[i] = logprob_entries(
                [tokens[i]], [chosen_l[n]], [values_l[n][:k]], [ids_l[n][:k]]
            )
    return tokens, logprobs


class OutputProcessor:
    """One job's sampled tokens in, final text deltas and the finish reason out."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        settings: SamplingSettings,
        max_new_tokens: int,
    ) -> None:
        self.stop_ids = set(settings.stop_token_ids)
        if not settings.ban_eos_token:
            self.stop_ids |= set(tokenizer.eos_token_ids)
        self.decoder = IncrementalDecoder(
            tokenizer, skip_special=settings.skip_special_tokens, context_ids=prompt_ids
        )
        self.stops = StopMatcher(settings.stop)
        self.max_new_tokens = max_new_tokens
        self.generated: list[int] = []

    def feed(self, token: int) -> tuple[str, str | None]:
        """The text `token` completes and, if generation ends here, why."""
        self.generated.append(token)
        if token in self.stop_ids:
            return self._flush(), "stop"
        text, hit = self.stops.feed(self.decoder.add([token]))
        if hit:
            return text, "stop"
        if len(self.generated) >= self.max_new_tokens:
            tail = self._flush()
            return text + tail, "stop" if self.stops.matched else "length"
        return text, None

    def _flush(self) -> str:
        # Incomplete UTF-8 left in the decoder is still checked for stop strings; what is
        # left held back after that can no longer become one.
        tail, hit = self.stops.feed(self.decoder.flush())
        return tail + ("" if hit else self.stops.flush())


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

    try:
        if max_new <= 0:
            yield event("", [], "length")
            return
        logits = session.prefill(prompt_ids)
        prompt_seconds = time.perf_counter() - started
        while True:
            tokens, logprobs = sample_jobs([sampling], logits.unsqueeze(0))
            token = tokens[0]
            text, reason = output.feed(token)
            yield event(text, [token], reason, logprobs[0])
            if reason is not None:
                return
            logits = session.step(token)
    finally:
        session.close()
