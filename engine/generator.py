"""Per-job generation pieces: events, sampling a job's tokens, output processing.

The scheduler (engine/scheduler.py) and the single-job loop (engine/generate.py) both use
them, so the two paths emit the same tokens and text. A `GenerationEvent` is a text delta
with the token ids behind it (and their logprobs when asked for), timings on every event,
and on the last one the finish reason ("stop" for EOS, a stop token or a stop string;
"length" for max_new_tokens or a full context; "cancelled"; "error", the stream then
raising).

The pieces: `JobSampler` + `sample_jobs`: each job's own
`Sampler` (its seed, its state) and context; plain greedy rows argmax-ed together, rows
with only temperature/top_k/top_p/min_p drawn together (engine/samplers/batched.py, the
same tokens as their own samplers), one host sync per batch. `OutputProcessor`: stop
token ids, then the incremental detokenizer (which holds back incomplete UTF-8), then
the banned-string filter (engine/banned_strings.py: holds back text and tokens that may
become a banned string, and asks for a rewind when one completes), then the stop-string
matcher (which holds back text that may still become a stop string, engine/stops.py). So
every delta is final text, neither a stop string nor a banned string reaches the stream,
and the two paths emit the same tokens. The single-job loop rewinds by computing the kept
tokens again in a fresh session; the scheduler trims the job's cache.

Logprobs: the settings key `logprobs` (an int k >= 0, in `SamplingSettings.extra`) adds,
per token, its log-probability under the model's raw distribution (log_softmax of the
logits, before penalties and temperature, as OpenAI reports them) and the k most likely
tokens with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.banned_strings import BannedStrings
from engine.samplers.batched import (
    Argmax,
    batchable,
    host_to_device,
    sample_batched,
    torch_argmax,
)
from engine.sampling import Sampler
from engine.sampling_settings import SamplingSettings, SamplingSettingsError
from engine.stops import StopMatcher
from engine.tokenizer import IncrementalDecoder, Tokenizer


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
    draft_tokens: int = 0  # speculative decoding: drafts proposed for this job so far
    accepted_tokens: int = 0  # ... and how many of them the target accepted

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
        raise SamplingSettingsError(
            f"logprobs must be an integer >= 0, got {value!r}", param="logprobs"
        )
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
        self.batchable = batchable(self.sampler)
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
            self._context[self._length : self._length + token.numel()] = token
        self._length += token.numel()

    def truncate(self, length: int) -> None:
        """Forget the context past `length` tokens (a rewind); min_new_tokens counts from
        there again. Mirostat's mu is not rewound: it keeps what the dropped draws taught it."""
        # (plain greedy draws skip the sampler and leave its count at 0)
        self.sampler.generated = max(0, self.sampler.generated - (self._length - length))
        self._length = length


def sample_jobs(
    jobs: list[JobSampler],
    logits: torch.Tensor,
    bans: list[list[int]] | None = None,
    argmax: Argmax = torch_argmax,
) -> tuple[list[int], list[list[TokenLogprob] | None]]:
    """One token per row of logits [N, V], row i drawn by jobs[i]; with logprobs where asked.
    `bans[i]`: token ids row i must not take here (banned strings' rewinds). One host sync
    for the whole batch (see `draw_jobs`)."""
    out = draw_jobs(jobs, logits, bans, argmax)
    return out.tolist(), logprobs_for(jobs, logits, out)


class TokenReadback:
    """Values of a device tensor copied to pinned host memory as soon as the stream gets
    there: `tolist()` waits for that copy only, not for the work queued after it (a plain
    `.tolist()` would wait for the whole stream, e.g. the scheduler's lookahead forward)."""

    def __init__(self, values: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if values.device.type != "cuda":
            self._host = values
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(values.device))

    def tolist(self) -> list[Any]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def draw_jobs(
    jobs: list[JobSampler],
    logits: torch.Tensor,
    bans: list[list[int]] | None = None,
    argmax: Argmax = torch_argmax,
) -> torch.Tensor:
    """`sample_jobs`' tokens as int64 [N] on the logits' device, without a host sync (the
    scheduler's lookahead feeds them to the next step before reading them).

    Plain greedy rows are argmax-ed together, rows with only temperature/top_k/top_p/min_p
    (or greedy with only a bias and bans) are drawn together (engine/samplers/batched.py),
    each other row goes through its own sampler (its seed, its state)."""
    device = logits.device
    if bans and any(bans):
        logits = apply_position_bans(logits, bans)
    plain = [i for i, job in enumerate(jobs) if job.plain_greedy]
    done = set(plain)
    together = [i for i, job in enumerate(jobs) if i not in done and job.batchable]
    if len(plain) == len(jobs):
        out = argmax(logits)
    elif len(together) == len(jobs):  # no index to gather and scatter through
        out = sample_batched([job.sampler for job in jobs], logits, argmax)
    else:
        out = torch.empty(len(jobs), dtype=torch.int64, device=device)
        if plain:
            index = host_to_device(torch.tensor(plain), device)
            out[index] = argmax(logits[index])
        if together:
            index = host_to_device(torch.tensor(together), device)
            out[index] = sample_batched([jobs[i].sampler for i in together], logits[index], argmax)
        for i, job in enumerate(jobs):
            if i not in done and not job.batchable:
                out[i : i + 1] = job.sampler.sample_batch(logits[i : i + 1], job.context())
    for i, job in enumerate(jobs):
        job.append(out[i : i + 1])
    return out


def apply_position_bans(logits: torch.Tensor, bans: list[list[int]]) -> torch.Tensor:
    """Logits [N, V] with row i's `bans[i]` set to -inf."""
    rows = [i for i, ids in enumerate(bans) for _ in ids]
    cols = [t for ids in bans for t in ids]
    mask = torch.zeros(logits.shape, dtype=torch.bool)
    mask[rows, cols] = True
    return logits.masked_fill(host_to_device(mask, logits.device), float("-inf"))


def logprobs_for(
    jobs: list[JobSampler], logits: torch.Tensor, tokens: torch.Tensor
) -> list[list[TokenLogprob] | None]:
    """Each asking row's logprob entry for its token (raw logits, as OpenAI reports)."""
    want = [i for i, job in enumerate(jobs) if job.logprobs_k is not None]
    logprobs: list[list[TokenLogprob] | None] = [None] * len(jobs)
    if not want:
        return logprobs
    k = max(jobs[i].logprobs_k or 0 for i in want)
    index = torch.tensor(want, device=logits.device)
    chosen, values, ids = token_logprobs(logits[index], tokens[index], k)
    chosen_l, values_l, ids_l = chosen.tolist(), values.tolist(), ids.tolist()
    tokens_l = tokens[index].tolist()
    for n, i in enumerate(want):
        k = jobs[i].logprobs_k or 0
        logprobs[i] = logprob_entries(
            [tokens_l[n]], [chosen_l[n]], [values_l[n][:k]], [ids_l[n][:k]]
        )
    return logprobs


@dataclass
class Fed:
    """What one sampled token did to a job's output."""

    text: str  # final text to emit
    token_ids: list[int]  # tokens now final (text held for a banned string holds them too)
    finish_reason: str | None = None
    rewind: int | None = None  # a banned string began in generated token `rewind`: go back
    banned_token: int | None = None  # the token that was there, to ban at that position


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
        self._tokenizer = tokenizer
        self._prompt = prompt_ids
        self._skip_special = settings.skip_special_tokens
        self.decoder = self._new_decoder()
        self.stops = StopMatcher(settings.stop)
        self.banned = BannedStrings(settings.banned_strings)
        self.max_new_tokens = max_new_tokens
        self.generated: list[int] = []
        self.final = 0  # generated tokens handed out as final
        self.rewinds = 0

    def _new_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(
            self._tokenizer, skip_special=self._skip_special, context_ids=self._prompt
        )

    def feed(self, token: int) -> tuple[str, str | None]:
        """The text `token` completes and, if generation ends here, why (no banned strings:
        see `feed_token`)."""
        fed = self.feed_token(token)
        return fed.text, fed.finish_reason

    def feed_token(self, token: int) -> Fed:
        self.generated.append(token)
        index = len(self.generated) - 1
        if token in self.stop_ids:
            return self._end(index, self.decoder.flush(), "stop")
        delta = self.decoder.add([token])
        if self.banned:
            delta, rewind = self.banned.feed(index, delta)
            if rewind is not None:
                return self._rewind(rewind)
        text, hit = self.stops.feed(delta)
        if hit:
            return Fed(text, self._take_final(), "stop")
        if len(self.generated) >= self.max_new_tokens:
            end = self._end(index, self.decoder.flush(), "length")
            if end.rewind is None:
                end.text = text + end.text
            return end
        return Fed(text, self._take_final())

    def _end(self, index: int, tail: str, reason: str) -> Fed:
        # Incomplete UTF-8 left in the decoder is still checked for banned and stop strings;
        # what is left held back after that can no longer become one.
        if self.banned:
            tail, rewind = self.banned.feed(index, tail)
            if rewind is not None:
                return self._rewind(rewind)
            tail += self.banned.flush()
        text, hit = self.stops.feed(tail)
        text += "" if hit else self.stops.flush()
        if reason == "length" and (hit or self.stops.matched):
            reason = "stop"
        return Fed(text, self._take_final(everything=True), reason)

    def _take_final(self, *, everything: bool = False) -> list[int]:
        held = None if everything else self.banned.held_from
        end = len(self.generated) if held is None else held
        ids = self.generated[self.final : end]
        self.final = max(self.final, end)
        return ids

    def _rewind(self, index: int) -> Fed:
        """Drop generated tokens from `index` on; the decoder replays what is left (its text
        is already emitted or held, so the replay's output is dropped)."""
        token = self.generated[index]
        del self.generated[index:]
        self.rewinds += 1
        self.decoder = self._new_decoder()
        self.decoder.add(self.generated)
        return Fed("", [], None, index, token)


class PositionBans:
    """Tokens banned at generated positions by banned-string rewinds. A rewind to position
    i bans the token that was there and forgets the bans past i (they were made for text
    that no longer exists); bans at i accumulate while the job keeps coming back to it."""

    def __init__(self) -> None:
        self._bans: dict[int, set[int]] = {}

    def at(self, position: int) -> list[int]:
        return sorted(self._bans.get(position, ()))

    def rewind(self, position: int, token: int | None) -> None:
        self._bans = {p: b for p, b in self._bans.items() if p <= position}
        if token is not None:
            self._bans.setdefault(position, set()).add(token)
