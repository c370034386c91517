"""The scheduler's records: a job (one request), a row (a job's part of one step), the
tokens of a step still on the device (the lookahead's one execute in flight), and the
errors a job can end with. Plain bookkeeping: nothing here reaches the model.

Kinds of job:
- "generate": a prompt, then sampled tokens until a stop (events stream out);
- "logits": a prompt whose every position's logits are wanted (`Engine.logits`,
  perplexity, TGW's logits);
- "hidden": a text whose every position's final hidden state is wanted (embeddings);
- "session": tokens fed from outside, a piece at a time, each piece answered with its
  last token's logits (engine/session.py: the single-job reference loop over the
  engine). Between pieces it keeps its cache and takes no step; it ends when closed.
Logits, hidden and session jobs sample nothing, adopt and publish no prefix-cache pages
(nothing stays cached) and gather their output in `Job.outputs`; logits and hidden jobs
end with finish_reason "length".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.constraints.state import JobConstraint
from engine.errors import KestrelError
from engine.generator import (
    GenerationEvent,
    JobSampler,
    OutputProcessor,
    PositionBans,
    TokenLogprob,
    TokenReadback,
)
from engine.pages import Sequence
from engine.prefix_cache import PrefixChain, root_hash
from engine.sampling_settings import SamplingSettings
from engine.speculative import NgramDrafter, can_speculate
from engine.tokenizer import Tokenizer

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"
GENERATE, LOGITS, HIDDEN, SESSION = "generate", "logits", "hidden", "session"


class SchedulerError(KestrelError, RuntimeError):
    """The scheduler cannot take or run a job (closed, or a job of another scheduler)."""


class QueueFullError(SchedulerError):
    """`max_waiting` jobs already wait."""


class GenerationMemoryError(KestrelError, RuntimeError):
    """A job's step ran out of (GPU or host) memory; that job ended, the others go on."""


class LoraBooks(Protocol):
    """What the scheduler needs of the LoRA manager: selections and who holds them."""

    def resolve(self, selection: Mapping[str, float] | None) -> dict[str, float]: ...
    def acquire(self, selection: Mapping[str, float]) -> None: ...
    def release(self, selection: Mapping[str, float]) -> None: ...
    def salt(self, selection: Mapping[str, float]) -> str: ...


class NoLoras:
    """The LoRA books of a closed scheduler: it no longer holds the manager (which holds
    the model), and whatever still asks for a selection is told the model is gone."""

    def resolve(self, selection: Mapping[str, float] | None) -> dict[str, float]:
        raise SchedulerError("the scheduler is closed (the model was unloaded)")

    def acquire(self, selection: Mapping[str, float]) -> None:
        raise SchedulerError("the scheduler is closed (the model was unloaded)")

    def release(self, selection: Mapping[str, float]) -> None:
        pass  # the adapters went with the model

    def salt(self, selection: Mapping[str, float]) -> str:
        return ""


class Job:
    """One request: prompt, settings, state, cache place and queued events."""

    def __init__(
        self,
        job_id: int,
        prompt_ids: list[int],
        settings: SamplingSettings,
        *,
        max_new_tokens: int,
        tokenizer: Tokenizer,
        logits_device: torch.device,
        page_size: int,
        loras: dict[str, float],
        lora_salt: str,
        speculate: bool = False,
        ngram: bool = False,
        kind: str = GENERATE,
    ) -> None:
        self.id = job_id
        self.kind = kind
        self.prompt_ids = prompt_ids
        self.settings = settings
        self.max_new_tokens = max_new_tokens
        self.state = WAITING
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.cached_tokens = 0  # prompt tokens adopted from the prefix cache
        self.prefill_tokens = 0  # prompt tokens computed
        self.sequence = Sequence()
        self.tokens = list(prompt_ids)  # prompt + generated; the cache holds a prefix of it
        # Resolved LoRA selection; K/V computed under it is cached apart from other selections.
        self.loras = loras
        self.lora_held = False
        self.chain = PrefixChain(page_size, root_hash(lora_salt))
        self.published = 0  # full pages registered in the prefix cache
        self.events: deque[GenerationEvent] = deque()
        self.submitted = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.sampling = JobSampler(settings, tokenizer, logits_device, prompt_ids, max_new_tokens)
        self.output = OutputProcessor(tokenizer, prompt_ids, settings, max_new_tokens)
        self.bans = PositionBans()  # banned strings' rewinds: tokens banned per position
        self.held_logprobs: list[TokenLogprob | None] = []  # per generated token
        self.preemptions = 0
        self.speculate = speculate and kind == GENERATE and can_speculate(self.sampling.sampler)
        self.drafter = NgramDrafter() if ngram and self.speculate else None
        self.draft_sequence = Sequence()  # the job's place in a draft model's cache
        self.draft_tokens = 0  # drafts proposed / accepted for this job
        self.accepted_tokens = 0
        # Constrained decoding (engine/constraints): the job's grammar matcher, if any.
        self.constraint: JobConstraint | None = None
        # A logits job's [n, vocab] pieces, a hidden job's [n, hidden] (float32, CPU), a
        # session's last logits [1, vocab] of each piece fed.
        self.outputs: list[torch.Tensor] = []
        # A logits job that scores its own tokens: each piece's outputs are [Σ NLL of the
        # tokens it predicts, their count] (float64, CPU), computed where the logits are.
        self.score_tokens = False

    @property
    def done(self) -> bool:
        return self.state == FINISHED

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    def event(
        self, text: str, ids: list[int], reason: str | None, lp: list[TokenLogprob] | None
    ) -> GenerationEvent:
        now = time.perf_counter()
        admitted = self.admitted or now
        first = self.first_token or now
        return GenerationEvent(
            text=text,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=len(self.prompt_ids),
            generated_tokens=len(self.tokens) - len(self.prompt_ids),
            prompt_seconds=first - admitted,
            generate_seconds=now - first,
            seed=self.sampling.seed,
            job_id=self.id,
            logprobs=lp,
            cached_tokens=self.cached_tokens,
            queue_seconds=admitted - self.submitted,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
        )


@dataclass(eq=False)
class Row:
    """One job's part of a step: the tokens it feeds and the drafts after them."""

    job: Job
    feed: list[int]
    drafts: list[int] = field(default_factory=list)
    chunk: bool = False  # a prefill chunk (counted in job.prefill_tokens)
    draft_k: int = 0  # drafts the runner's draft model may add after `feed`

    @property
    def logits_wanted(self) -> int:
        """Rows of output this row gets: all its tokens for a logits or hidden job, its
        last token for a session, else its last token and its drafts."""
        if self.job.kind in (LOGITS, HIDDEN):
            return len(self.feed)
        return 1 + len(self.drafts)


@dataclass(eq=False)
class Drawn:
    """A step's tokens, drawn on the device and not read back yet."""

    jobs: list[Job]
    tokens: torch.Tensor  # int64 [len(jobs)], on the logits' device
    readback: TokenReadback  # their copy to the host, queued right after the draw


def requeue(events: list[GenerationEvent], jobs: list[Job]) -> None:
    """Queue `events` on their jobs (among `jobs`) for their streams: what a `step()` made
    before it failed, which it can no longer return."""
    by_id = {job.id: job for job in jobs}
    for event in events:
        by_id[event.job_id].events.append(event)
