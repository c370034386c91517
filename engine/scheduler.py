"""Continuous batching over the paged KV cache: a job queue and the scheduler that runs it.

Contract:
- `Scheduler(engine, max_batch=, max_tokens_per_step=, max_waiting=None, prefix_caching=True)`;
  the engine makes one (`engine.scheduler`) from its options.
- `submit(prompt_ids, settings) -> Job` checks everything at once and raises:
  `ContextLengthError` for an empty prompt or one longer than the context (max_seq_len);
  `CacheFullError` for a prompt that needs more pages than the whole cache has (it could
  never run); `QueueFullError` when `max_waiting` jobs already wait; `ValueError` for token
  ids outside the vocabulary; `SamplingSettingsError` for bad settings. It never refuses
  for lack of room now: the job waits. max_new_tokens is clamped so that the prompt and the
  new tokens fit the context and the cache; a clamped job ends with finish_reason "length".
- `step()` runs one engine forward: one decode token for every running job, then prefill
  chunks (oldest job first) within `max_tokens_per_step`, admitting waiting jobs in order
  while the batch (`max_batch`), the token budget and the cache have room. Each job whose
  prompt is complete samples with its own `Sampler`. Returns the events it made (and
  delivers them only there: drive a job by `step()` or by streaming it, not both).
- `stream(job)` / `stream_many(jobs)` yield events; a consumer with no event pending runs
  `step()` itself under the engine's lock, so one thread or many can consume, and there is
  no background thread. Closing such an iterator early cancels its unfinished jobs.
- `cancel(job)` frees the job's pages at once, whatever its state, and ends it with
  finish_reason "cancelled". A failing forward ends the jobs of that step with "error" (their
  streams raise the exception) and leaves the scheduler usable.
- Admission reserves a job's worst case: it is admitted only when the cache can hold
  prompt + max_new_tokens - 1 tokens on top of what admitted jobs may still claim. So a
  running job never finds the cache full and nothing is preempted; the queue absorbs load.
  The price: size `cache_tokens` for the batch wanted (the default holds one context).
- Events are `GenerationEvent`s (engine/generator.py): text delta, token ids, logprobs,
  finish reason, and timings (queue_seconds, prompt_seconds = prefill, generate_seconds =
  decode, tokens_per_second, cached_tokens).
- LoRA (engine/lora): `submit` resolves the job's selection (`settings.loras`, None: the
  model's default) and holds its adapters until the job ends (`LoraError` for an unknown
  or unloading name); each step passes every row's selection to the forward, so one batch
  mixes adapters. The prefix cache keeps each selection's pages apart.
- Prefix caching (engine/prefix_cache.py): at admission a job adopts the cached full pages
  its prompt starts with, at most those before its last prompt token (one token is always
  computed, for the logits, and the job's partially filled page is always its own: shared
  pages are never written, so no copy-on-write is needed). It registers its own full pages
  (prompt and generated tokens) as they fill. `Job.cached_tokens` and the events report it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.cache import CacheFullError, Sequence
from engine.generator import (
    GenerationEvent,
    JobSampler,
    OutputProcessor,
    TokenLogprob,
    sample_jobs,
)
from engine.prefix_cache import PrefixChain, adopt, find_prefix, publish, root_hash
from engine.sampling_settings import SamplingSettings

if TYPE_CHECKING:
    from engine.engine import Engine

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


class SchedulerError(RuntimeError):
    """The scheduler cannot take or run a job (closed, or a job of another scheduler)."""


class QueueFullError(SchedulerError):
    """`max_waiting` jobs already wait."""


class Job:
    """One request: prompt, settings, state, cache place and queued events."""

    def __init__(
        self,
        job_id: int,
        prompt_ids: list[int],
        settings: SamplingSettings,
        engine: Engine,
        max_new_tokens: int,
        loras: dict[str, float] | None = None,
    ) -> None:
        self.id = job_id
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
        page_size = engine.cache.page_size
        # The cache holds every token but the last one sampled.
        self.pages_needed = -(-(len(prompt_ids) + max_new_tokens - 1) // page_size)
        # Resolved LoRA selection; K/V computed under it is cached apart from other selections.
        self.loras = loras or {}
        self.lora_held = False
        self.chain = PrefixChain(page_size, root_hash(engine.loras.salt(self.loras)))
        self.published = 0  # full pages registered in the prefix cache
        self.events: deque[GenerationEvent] = deque()
        self.submitted = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.sampling = JobSampler(
            settings, engine.tokenizer, engine.logits_device, prompt_ids, max_new_tokens
        )
        self.output = OutputProcessor(engine.tokenizer, prompt_ids, settings, max_new_tokens)

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
        )


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 64,
        max_tokens_per_step: int = 2048,
        max_waiting: int | None = None,
        prefix_caching: bool = True,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_tokens_per_step < max_batch:
            # Otherwise decode tokens could use the whole budget and starve every prefill.
            raise ValueError(
                f"max_tokens_per_step ({max_tokens_per_step}) must be >= max_batch ({max_batch})"
            )
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_tokens_per_step = max_tokens_per_step
        self.max_waiting = max_waiting
        self.prefix_caching = prefix_caching
        self.lock = engine.lock
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []  # admitted (prefilling or decoding), in admission order
        self._next_id = 1
        self._closed = False

    # -- public API ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def usable_pages(self) -> int:
        # The decode graphs keep one scratch page for their padding rows (engine/cuda_graph.py).
        return self.engine.cache.num_pages - int(self.engine.graphs is not None)

    def stats(self) -> dict[str, int]:
        cache = self.engine.cache
        return {
            "waiting": len(self._waiting),
            "running": len(self._running),
            "num_pages": cache.num_pages,
            "usable_pages": self.usable_pages,
            "free_pages": cache.free_pages,
            "cached_pages": cache.cached_pages,
            "page_size": cache.page_size,
        }

    def submit(
        self,
        prompt_ids: Iterable[int],
        settings: SamplingSettings | Mapping[str, Any] | None = None,
    ) -> Job:
        """Queue a job; see the module docstring for what is refused and why."""
        if self._closed:
            raise SchedulerError("the scheduler is closed (the model was unloaded)")
        settings = SamplingSettings.from_any(settings)
        prompt = [int(t) for t in prompt_ids]
        engine = self.engine
        engine.check_length(len(prompt))
        vocab = engine.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        page_size = engine.cache.page_size
        usable_tokens = self.usable_pages * page_size
        if len(prompt) > usable_tokens:
            raise CacheFullError(
                f"the prompt has {len(prompt)} tokens; the KV cache holds {usable_tokens} "
                f"({self.usable_pages} pages of {page_size}): raise cache_tokens"
            )
        with self.lock:
            if self._closed:
                raise SchedulerError("the scheduler is closed (the model was unloaded)")
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFullError(
                    f"{len(self._waiting)} jobs are waiting (max_waiting={self.max_waiting})"
                )
            max_new = min(
                settings.max_new_tokens,
                engine.max_seq_len - len(prompt),
                usable_tokens - len(prompt) + 1,
            )
            loras = engine.loras.resolve(settings.loras)
            job = Job(self._next_id, prompt, settings, engine, max(0, max_new), loras)
            engine.loras.acquire(loras)
            job.lora_held = True
            self._next_id += 1
            if job.max_new_tokens == 0:
                self._finish(job, "length")
            else:
                self._waiting.append(job)
            return job

    def step(self) -> list[GenerationEvent]:
        """One forward over everything runnable; returns the events it made.

        Those events are delivered here and not queued for `stream`: drive a job either by
        calling `step()` or by streaming it, not both (the events of `cancel` and of a
        failed forward are always queued; a failed forward also raises here)."""
        with self.lock:
            return self._step(queue=False)

    def cancel(self, job: Job) -> None:
        """End `job` now and free its pages; a finished job is left as it is."""
        with self.lock:
            if not job.done:
                self._finish(job, "cancelled")

    def close(self) -> None:
        """Cancel every job and refuse new ones (the engine is being unloaded)."""
        with self.lock:
            self._closed = True
            for job in [*self._running, *self._waiting]:
                self._finish(job, "cancelled")

    def stream(self, job: Job) -> Iterator[GenerationEvent]:
        """Events of one job until it finishes; closing the iterator cancels the job."""
        yield from self.stream_many([job])

    def stream_many(self, jobs: Iterable[Job]) -> Iterator[GenerationEvent]:
        """Events of several jobs (`event.job_id` tells them apart) until all finish."""
        jobs = list(jobs)
        with self.lock:
            foreign = [
                j.id for j in jobs if not (j.done or j in self._running or j in self._waiting)
            ]
        if foreign:
            raise SchedulerError(f"jobs {foreign} were not submitted to this scheduler")
        try:
            while True:
                with self.lock:
                    ready = [e for job in jobs for e in self._drain(job)]
                    if not ready:
                        if all(job.done for job in jobs):
                            return
                        if not self._step(queue=True) and not self._running:
                            self._stalled()
                        ready = [e for job in jobs for e in self._drain(job)]
                yield from ready
                failed = next((job for job in jobs if job.error is not None), None)
                if failed is not None:
                    raise failed.error
        finally:
            with self.lock:
                for job in jobs:
                    if not job.done:
                        self._finish(job, "cancelled")

    # -- one step ------------------------------------------------------------------------
    def _step(self, *, queue: bool) -> list[GenerationEvent]:
        batch: list[Job] = []
        new_tokens: list[list[int]] = []
        for job in self._running:
            if job.state == DECODE:
                batch.append(job)
                new_tokens.append([job.tokens[-1]])
        budget = self.max_tokens_per_step - len(batch)
        for job in self._running:
            if job.state == PREFILL and budget > 0:
                budget -= self._add_chunk(job, budget, batch, new_tokens)
        while self._waiting and budget > 0 and len(self._running) < self.max_batch:
            job = self._waiting[0]
            if not self._admit(job):
                break  # first come, first served: later jobs do not overtake it
            self._waiting.popleft()
            self._running.append(job)
            budget -= self._add_chunk(job, budget, batch, new_tokens)
        if not batch:
            return []
        try:
            logits = self.engine.forward(
                [job.sequence for job in batch], new_tokens, loras=[job.loras for job in batch]
            )
            sampling = [
                (row, job)
                for row, job in enumerate(batch)
                if job.sequence.length >= len(job.prompt_ids)
            ]
            for job in batch:
                if self.prefix_caching:
                    job.published = publish(
                        self.engine.cache, job.sequence, job.chain, job.tokens, job.published
                    )
            tokens, logprobs = self._sample(sampling, logits)
        except BaseException as error:
            for job in batch:
                job.error = error
                self._finish(job, "error")
            raise
        events = []
        for (_, job), token, lp in zip(sampling, tokens, logprobs, strict=True):
            if job.state == PREFILL:
                job.state = DECODE
                job.first_token = time.perf_counter()
            job.tokens.append(token)
            text, reason = job.output.feed(token)
            events.append(job.event(text, [token], reason, lp))
            if queue:
                job.events.append(events[-1])
            if reason is not None:
                self._finish(job, reason, emit=False)
        return events

    def _add_chunk(
        self, job: Job, budget: int, batch: list[Job], new_tokens: list[list[int]]
    ) -> int:
        start = job.sequence.length
        chunk = job.prompt_ids[start : start + budget]
        batch.append(job)
        new_tokens.append(chunk)
        job.prefill_tokens += len(chunk)
        return len(chunk)

    def _admit(self, job: Job) -> bool:
        cache = self.engine.cache
        pages: list[int] = []
        if self.prefix_caching:
            max_pages = (len(job.prompt_ids) - 1) // cache.page_size
            pages = find_prefix(cache, job.chain, job.prompt_ids, max_pages)
        # Adopting a page that only the LRU holds uses up a free page; one that another job
        # holds does not.
        held_elsewhere = sum(cache.refcount(p) > 0 for p in pages)
        claimed = sum(max(0, j.pages_needed - len(j.sequence.pages)) for j in self._running)
        if job.pages_needed - held_elsewhere > cache.free_pages - claimed:
            return False
        job.cached_tokens = adopt(cache, job.sequence, pages)
        job.published = len(pages)
        job.state = PREFILL
        job.admitted = time.perf_counter()
        return True

    def _sample(
        self, sampling: list[tuple[int, Job]], logits: torch.Tensor
    ) -> tuple[list[int], list[list[TokenLogprob] | None]]:
        if not sampling:
            return [], []
        rows = [row for row, _ in sampling]
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        return sample_jobs([job.sampling for _, job in sampling], logits)

    def _stalled(self) -> None:
        # Only pages held outside the scheduler (an EngineSession) can cause this: a job
        # that fits the empty cache is admitted when nothing else runs.
        job = self._waiting[0]
        raise SchedulerError(
            f"job {job.id} needs {job.pages_needed} pages and nothing runs, but only "
            f"{self.engine.cache.free_pages} of {self.usable_pages} are free: pages are held "
            "outside the scheduler"
        )

    # -- finishing -----------------------------------------------------------------------
    def _finish(self, job: Job, reason: str, *, emit: bool = True) -> None:
        if job in self._running:
            self._running.remove(job)
        elif job in self._waiting:
            self._waiting.remove(job)
        if self.engine.cache is not None:
            job.sequence.release(self.engine.cache)
        if job.lora_held and self.engine.loras is not None:
            job.lora_held = False
            self.engine.loras.release(job.loras)  # may free an adapter waiting to unload
        job.state = FINISHED
        job.finish_reason = reason
        if emit:
            job.events.append(job.event("", [], reason, None))

    def _drain(self, job: Job) -> list[GenerationEvent]:
        events = list(job.events)
        job.events.clear()
        return events
