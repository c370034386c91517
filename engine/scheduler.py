"""Continuous batching over the paged KV cache: a job queue and the scheduler that runs it.

One step is `plan = schedule()` -> `output = runner.execute(plan)` -> `update(plan,
output)`: this module keeps the books (jobs, pages, prefix cache, preemption, stops,
events) and imports no model code; the runner (engine/runner.py, any `engine.step.Runner`)
runs the forward. tests/project/test_layering.py checks that no import reaches the model.

Contract:
- `Scheduler(runner, pages, *, tokenizer, vocab_size, max_seq_len, logits_device, loras,
  lock, max_batch=, max_tokens_per_step=, max_waiting=None, prefix_caching=True,
  lookahead=True)`; the engine makes one (`engine.scheduler`, `Engine.new_scheduler`)
  from its options, over its runner, cache pages and LoRA manager.
- `submit_logits(prompt_ids, loras=None) -> Job` / `logits(...)`: a logits job, every
  position's logits of the prompt (job.outputs), batched with generation; it neither
  adopts nor publishes prefix-cache pages. `hidden_states(inputs)`: a hidden job per
  input (embeddings), every position's final hidden state; their chunks share steps of
  their own (a forward yields logits or hidden states, not both), which alternate with
  the other jobs' steps. `open_session(loras=None) -> EngineSession` (engine/session.py):
  a session job, fed tokens from outside (`feed`), each piece answered with its last
  token's logits; it keeps its pages between pieces and gives them up (parked, computed
  again on its next piece) when a waiting job needs them. Every forward of the model goes
  through `step()`: there is no other way to the runner.
- `submit(prompt_ids, settings) -> Job` checks everything at once and raises:
  `ContextLengthError` for an empty prompt or one longer than the context (max_seq_len);
  `CacheFullError` for a prompt that needs more pages than the whole cache has (it could
  never run); `QueueFullError` when `max_waiting` jobs already wait; `ValueError` for token
  ids outside the vocabulary; `SamplingSettingsError` for bad settings. It never refuses
  for lack of room now: the job waits. max_new_tokens is clamped so that the prompt and the
  new tokens fit the context and the cache; a clamped job ends with finish_reason "length".
- `step()` runs one engine forward: one decode token for every running job (with its
  drafts when speculating), then prefill chunks (oldest job first) within
  `max_tokens_per_step`, admitting waiting jobs in order while the batch (`max_batch`), the
  token budget and the cache have room. A job feeds the tokens its cache lacks
  (`job.tokens[sequence.length:]`): its prompt, one sampled token, or after a preemption or
  a rewind the tokens to compute again. Each job whose tokens are all in the cache samples
  with its own `Sampler`. Returns the events it made (and delivers them only there: drive
  a job by `step()` or by streaming it, not both).
- `stream(job)` / `stream_many(jobs)` yield events; a consumer with no event pending has a
  step run under the engine's lock, on the scheduler's one step thread (so that a server
  consuming from many threads holds one cuBLAS workspace, not one per thread); one thread
  or many can consume. Closing such an iterator early cancels its unfinished jobs.
- `cancel(job)` frees the job's pages at once, whatever its state, and ends it with
  finish_reason "cancelled". A failing forward ends the jobs of that step with "error" (their
  streams raise the exception) and leaves the scheduler usable. A forward that runs out of
  memory (torch.OutOfMemoryError, MemoryError) ends only one job of the step, the one that
  fed the most tokens, with a `GenerationMemoryError` and frees its pages; the step is
  undone for the others, which go on as if it had not happened (`step()` does not raise).
- Admission and preemption: a job is admitted when the free pages hold its prompt with one
  page to spare per running job; its output is not reserved. When a step's decode tokens
  do not fit, the youngest running job is preempted: its pages are freed and it waits first
  in the queue, to compute its tokens again when admitted (adopting what the prefix cache
  still holds of them). Its sampler, output and stream carry on, so its tokens are the ones
  it would have produced without the preemption. A job that alone fits the cache always
  finishes: submit clamps max_new_tokens to the cache.
- Banned strings (`settings.banned_strings`, engine/banned_strings.py): text that may
  become one is held back with its tokens; when one completes, the job rewinds to the token
  where it began (tokens dropped, cache trimmed by engine/rewind.py, sampler context cut),
  that token is banned at that position and the position is sampled again.
- Speculative decoding (`set_speculation`, engine/speculative.py): decode rows of jobs
  whose sampler allows it carry k drafts (n-gram lookup or a draft model) and get logits
  for all k + 1 positions; the acceptance rule keeps the target's distribution (greedy:
  identical output), the rejected drafts' cache entries are trimmed, and `stats()` reports
  draft/accepted tokens, the acceptance rate and tokens per decode step.
- Events are `GenerationEvent`s (engine/generator.py): text delta, token ids, logprobs,
  finish reason, and timings (queue_seconds, prompt_seconds = prefill, generate_seconds =
  decode, tokens_per_second, cached_tokens, draft_tokens, accepted_tokens). An event may
  carry several tokens (accepted drafts); tokens held for a banned string come later.
- LoRA (engine/lora): `submit` resolves the job's selection (`settings.loras`, None: the
  model's default) and holds its adapters until the job ends (`LoraError` for an unknown
  or unloading name); each step passes every row's selection to the forward, so one batch
  mixes adapters. The prefix cache keeps each selection's pages apart.
- Lookahead (`lookahead=True`, the default), one execute in flight: a step whose rows
  all draw one token (no prompt chunk still short of its end, drafts, logprobs or logits
  jobs) draws it on the device and does not read it back at once (`Drawn`: their copy to
  pinned host memory is queued right behind the sampler). The next `step()` first
  launches the following decode forward with those tokens as its input (device to device
  into the decode graph's rows, `ModelRunner.forward_decode_tokens`), and only then
  waits for that copy alone and runs stops, detokenization and events, so that host work
  overlaps the GPU's forward. (A decode step of one job is ~2.5 ms of GPU work on an 8B
  model; reading its tokens back, detokenizing, checking stops and building events took
  another ~0.7 ms on the host, during which the GPU waited.) Stops are thus seen one
  forward late: a job that stopped (or rewound for a banned string) has its looked-ahead
  row dropped, and its cache slot with it. A step looks ahead only when every running
  job is in it and nothing else is due: no job waits for admission with room in the
  batch, no job needs a preemption for its next page, no LoRA, no speculation. Otherwise
  that `step()` reads and delivers the drawn tokens and then runs a normal step. A
  lookahead forward that runs out of memory is undone and a normal step follows (no job
  ends for it). Tokens and events are the same as without lookahead; `stats()` counts
  the forwards run ahead and those dropped.
- Prefix caching (engine/prefix_cache.py): at admission a job adopts the cached full pages
  its prompt starts with, at most those before its last prompt token (one token is always
  computed, for the logits, and the job's partially filled page is always its own: shared
  pages are never written, so no copy-on-write is needed). It registers its own full pages
  (prompt and generated tokens) as they fill. `Job.cached_tokens` and the events report it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F

from engine.constraints import (
    JobConstraint,
    compile_constraint,
    constraint_spec,
    sync_constraint,
    trim_drafts,
)
from engine.generator import (
    GenerationEvent,
    TokenLogprob,
)
from engine.jobs import (
    DECODE,
    FINISHED,
    GENERATE,
    HIDDEN,
    LOGITS,
    PREFILL,
    SESSION,
    WAITING,
    Drawn,
    GenerationMemoryError,
    Job,
    LoraBooks,
    NoLoras,
    QueueFullError,
    Row,
    SchedulerError,
    requeue,
)
from engine.limits import check_length
from engine.pages import CacheFullError, PagePool
from engine.prefix_cache import adopt, find_prefix, publish
from engine.rewind import trim_sequence
from engine.row_sampling import RowTokens, draw_rows, sample_rows
from engine.samplers.batched import host_to_device
from engine.sampling_settings import SamplingSettings
from engine.session import EngineSession
from engine.speculative import SPECULATIVE_MODES
from engine.step import DraftRequest, Runner, StepOutput, StepPlan
from engine.tokenizer import Tokenizer

__all__ = [
    "DECODE",
    "FINISHED",
    "PREFILL",
    "WAITING",
    "GenerationMemoryError",
    "Job",
    "QueueFullError",
    "Scheduler",
    "SchedulerError",
]


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        pages: PagePool,
        *,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_seq_len: int,
        logits_device: torch.device,
        loras: LoraBooks,
        lock: threading.RLock,
        max_batch: int = 64,
        max_tokens_per_step: int = 2048,
        max_waiting: int | None = None,
        prefix_caching: bool = True,
        lookahead: bool = True,
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
        self.runner = runner
        self.pages = pages
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.logits_device = logits_device
        self.loras = loras
        self.lock = lock
        self.max_batch = max_batch
        self.max_tokens_per_step = max_tokens_per_step
        self.max_waiting = max_waiting
        self.prefix_caching = prefix_caching
        self.lookahead = lookahead
        self._drawn: Drawn | None = None  # the execute in flight: a step's unread tokens
        self.lookahead_forwards = 0  # decode forwards launched before the last step's read
        self.lookahead_dropped = 0  # their rows dropped: the job stopped or rewound
        self.lookahead_failed = 0  # lookahead forwards undone for lack of memory
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []  # admitted (prefilling or decoding), in admission order
        self._next_id = 1
        self._closed = False
        self._reserved = 0  # pages the step being planned has claimed
        self._last_hidden = False  # the last step was one of hidden jobs
        self.speculative: str | None = None
        self.num_draft_tokens = 0
        self.speculative_max_batch = 0
        self.draft_pages: PagePool | None = None  # the draft model's cache (speculative="draft")
        self.preemptions = 0
        self.rewinds = 0
        self._drafted = 0
        self._accepted = 0
        self._decode_rows = 0  # decode steps of jobs, and the tokens they produced
        self._decode_tokens = 0
        self._stepper: ThreadPoolExecutor | None = None  # the step thread, made on first use
        self._step_thread: threading.Thread | None = None

    def set_speculation(
        self,
        mode: str | None,
        num_draft_tokens: int = 4,
        draft_pages: PagePool | None = None,
        max_batch: int = 16,
    ) -> None:
        """Speculative decoding for jobs submitted from now on: "ngram" (prompt lookup),
        "draft" (the runner's draft model, whose cache's pages are `draft_pages`), or None
        (off). Steps with more than `max_batch` decoding jobs run without drafts: a large
        batch already keeps the GPU busy, and k + 1 tokens per job would turn a
        memory-bound step into a compute-bound one."""
        if mode is not None and mode not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)} or None, got {mode!r}"
            )
        if mode == "draft" and draft_pages is None:
            raise ValueError('speculative="draft" needs a draft model (draft_model=path)')
        if mode is not None and num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {max_batch}")
        self.speculative = mode
        self.speculative_max_batch = max_batch
        self.num_draft_tokens = num_draft_tokens
        self.draft_pages = draft_pages if mode == "draft" else None

    # -- public API ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def usable_pages(self) -> int:
        return self.pages.num_pages

    def stats(self) -> dict[str, Any]:
        pages = self.pages
        return {
            "waiting": len(self._waiting),
            "running": len(self._running),
            "num_pages": pages.num_pages,
            "usable_pages": self.usable_pages,
            "free_pages": pages.free_pages,
            "cached_pages": pages.cached_pages,
            "page_size": pages.page_size,
            "preemptions": self.preemptions,
            "rewinds": self.rewinds,
            "speculative": self.speculative,
            "num_draft_tokens": self.num_draft_tokens if self.speculative else 0,
            "draft_tokens": self._drafted,
            "accepted_tokens": self._accepted,
            "acceptance_rate": round(self._accepted / self._drafted, 4) if self._drafted else 0.0,
            # tokens a decoding job gains per step: 1 without speculation
            "tokens_per_step": (
                round(self._decode_tokens / self._decode_rows, 4) if self._decode_rows else 0.0
            ),
            "lookahead_forwards": self.lookahead_forwards,
            "lookahead_dropped_rows": self.lookahead_dropped,
            "lookahead_out_of_memory": self.lookahead_failed,
        }

    def submit(
        self,
        prompt_ids: Iterable[int],
        settings: SamplingSettings | Mapping[str, Any] | None = None,
    ) -> Job:
        """Queue a generation job; see the module docstring for what is refused and why."""
        return self._submit(prompt_ids, SamplingSettings.from_any(settings), GENERATE)

    def submit_logits(
        self, prompt_ids: Iterable[int], *, loras: Mapping[str, float] | None = None
    ) -> Job:
        """Queue a logits job: every position's logits of `prompt_ids` under the LoRA
        selection `loras` (None: the model's default), gathered in `job.outputs`."""
        selection = self.loras.resolve(loras)  # LoraError names a bad adapter or scale
        return self._submit(prompt_ids, SamplingSettings(loras=selection), LOGITS)

    def logits(
        self, prompt_ids: Iterable[int], *, loras: Mapping[str, float] | None = None
    ) -> torch.Tensor:
        """[len, vocab] (float32, CPU): a logits job, streamed to its end."""
        job = self.submit_logits(prompt_ids, loras=loras)
        for _ in self.stream(job):
            pass
        # One piece (a prompt within one prefill chunk) needs no copy.
        return job.outputs[0] if len(job.outputs) == 1 else torch.cat(job.outputs)

    def token_nll(
        self, prompt_ids: Iterable[int], *, loras: Mapping[str, float] | None = None
    ) -> tuple[float, int]:
        """(Σ NLL, count) of every token after the first given the ones before it: a logits
        job whose logits never leave the device (perplexity: a 1024-token window of a
        49k vocabulary is 200 MB of float32 logits otherwise copied to the host)."""
        selection = self.loras.resolve(loras)
        job = self._submit(prompt_ids, SamplingSettings(loras=selection), LOGITS, score=True)
        for _ in self.stream(job):
            pass
        return float(sum(float(part[0]) for part in job.outputs)), len(job.tokens) - 1

    def hidden_states(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Final hidden states [len, hidden] (float32, CPU) of each input, after the final
        norm, under the model's default LoRA selection: a hidden job per input, packed into
        shared forwards by the step's token budget (a long one over several). They count
        as one request against `max_waiting`."""
        jobs: list[Job] = []
        try:
            for ids in inputs:
                jobs.append(self._submit(ids, SamplingSettings(), HIDDEN, one_request=bool(jobs)))
        except BaseException:
            for job in jobs:  # a bad input refuses the whole request
                self.cancel(job)
            raise
        for _ in self.stream_many(jobs):
            pass
        return [torch.cat(job.outputs) for job in jobs]

    def _submit(
        self,
        prompt_ids: Iterable[int],
        settings: SamplingSettings,
        kind: str,
        *,
        one_request: bool = False,
        score: bool = False,
    ) -> Job:
        """`one_request`: a further part of a request already admitted to the queue (not
        refused for `max_waiting`)."""
        if self._closed:
            raise SchedulerError("the scheduler is closed (the model was unloaded)")
        prompt = [int(t) for t in prompt_ids]
        check_length(len(prompt), 0, self.max_seq_len)
        vocab = self.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        page_size = self.pages.page_size
        usable_tokens = self.usable_pages * page_size
        if len(prompt) > usable_tokens:
            raise CacheFullError(
                f"the prompt has {len(prompt)} tokens; the KV cache holds {usable_tokens} "
                f"({self.usable_pages} pages of {page_size}): raise cache_tokens"
            )
        constraint = self._constraint(settings)
        with self.lock:
            if self._closed:
                raise SchedulerError("the scheduler is closed (the model was unloaded)")
            if (
                not one_request
                and self.max_waiting is not None
                and len(self._waiting) >= self.max_waiting
            ):
                raise QueueFullError(
                    f"{len(self._waiting)} jobs are waiting (max_waiting={self.max_waiting})"
                )
            max_new = min(
                settings.max_new_tokens,
                self.max_seq_len - len(prompt),
                usable_tokens - len(prompt) + 1,
            )
            loras = self.loras.resolve(settings.loras)
            job = Job(
                self._next_id,
                prompt,
                settings,
                max_new_tokens=max(0, max_new) if kind == GENERATE else 0,
                tokenizer=self.tokenizer,
                logits_device=self.logits_device,
                page_size=page_size,
                loras=loras,
                lora_salt=self.loras.salt(loras),
                speculate=self.speculative is not None,
                ngram=self.speculative == "ngram",
                kind=kind,
            )
            job.constraint = constraint
            job.score_tokens = score
            self.loras.acquire(loras)
            job.lora_held = True
            self._next_id += 1
            if kind == GENERATE and job.max_new_tokens == 0:
                self._finish(job, "length")
            else:
                self._waiting.append(job)
            return job

    def _constraint(self, settings: SamplingSettings) -> JobConstraint | None:
        """The job's grammar matcher (compiled before the lock: a large grammar takes a while);
        ConstraintError for a schema or grammar that is wrong."""
        spec = constraint_spec(settings)
        if spec is None:
            return None
        tokenizer = self.tokenizer
        stop_ids = set(settings.stop_token_ids)
        if not settings.ban_eos_token:
            stop_ids |= set(tokenizer.eos_token_ids)
        return compile_constraint(spec, tokenizer, self.vocab_size, frozenset(stop_ids))

    def step(self) -> list[GenerationEvent]:
        """One forward over everything runnable; returns the events it made.

        Those events are delivered here and not queued for `stream`: drive a job either by
        calling `step()` or by streaming it, not both (the events of `cancel` and of a
        failed forward are always queued; a failed forward also raises here)."""
        with self.lock:
            return self._step(queue=False)

    def open_session(self, *, loras: Mapping[str, float] | None = None) -> EngineSession:
        """A session (engine/session.py) under the LoRA selection `loras` (None: the
        model's default): a session job, in no queue until it is fed."""
        selection = self.loras.resolve(loras)
        with self.lock:
            if self._closed:
                raise SchedulerError("the scheduler is closed (the model was unloaded)")
            job = Job(
                self._next_id,
                [],
                SamplingSettings(loras=selection),
                max_new_tokens=0,
                tokenizer=self.tokenizer,
                logits_device=self.logits_device,
                page_size=self.pages.page_size,
                loras=selection,
                lora_salt=self.loras.salt(selection),
                kind=SESSION,
            )
            self.loras.acquire(selection)
            job.lora_held = True
            self._next_id += 1
        return EngineSession(self, job)

    def feed(self, job: Job, tokens: Iterable[int]) -> torch.Tensor:
        """Feed `tokens` to the session job `job` and return the last one's logits [vocab]
        (float32, on the logits' device), computed in the next steps with whatever else
        runs."""
        ids = [int(t) for t in tokens]
        if not ids:
            raise ValueError("a session is fed one token or more")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        total = len(job.tokens) + len(ids)
        check_length(total, 0, self.max_seq_len)
        usable_tokens = self.usable_pages * self.pages.page_size
        if total > usable_tokens:
            raise CacheFullError(
                f"the session holds {total} tokens; the KV cache holds {usable_tokens}: "
                "raise cache_tokens"
            )
        with self.lock:
            if self._closed:
                raise SchedulerError("the scheduler is closed (the model was unloaded)")
            if job.kind != SESSION or job.done:
                raise SchedulerError(f"job {job.id} is not an open session")
            job.tokens.extend(ids)
            job.outputs.clear()
            if job not in self._running and job not in self._waiting:
                self._waiting.append(job)
        while True:
            with self.lock:
                if job.error is not None:
                    raise job.error
                if job.done:
                    raise SchedulerError(f"session {job.id} ended ({job.finish_reason})")
                if job.outputs and job.sequence.length == len(job.tokens):
                    return job.outputs[-1][0]
            self._on_step_thread(self._feed_step, [job])

    def _feed_step(self, jobs: list[Job]) -> list[GenerationEvent]:
        """What a session waiting for its logits does: one step (its events are queued
        for their jobs' streams)."""
        with self.lock:
            if not self._step(queue=True) and not self._running and self._waiting:
                self._stalled()
        return []

    def cancel(self, job: Job) -> None:
        """End `job` now and free its pages; a finished job is left as it is."""
        with self.lock:
            if not job.done:
                self._finish(job, "cancelled")

    def close(self) -> None:
        """Cancel every job and refuse new ones (the engine is being unloaded)."""
        with self.lock:
            self._closed = True
            self._drawn = None
            for job in [*self._running, *self._waiting]:
                self._finish(job, "cancelled")
            # Every page is free now: hold the cache (its K/V storage) and the LoRA
            # manager (the model) no longer.
            self.pages = PagePool(num_pages=0, page_size=self.pages.page_size)
            self.draft_pages = None
            self.loras = NoLoras()
            if self._stepper is not None:
                self._stepper.shutdown(wait=False)
                self._stepper = None

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
                    done = all(job.done for job in jobs)
                if not ready:
                    if done:
                        return
                    ready = self._on_step_thread(self._stream_step, jobs)
                failed = next((job for job in jobs if job.error is not None), None)
                if failed is not None:
                    # Raise instead of yielding the "error" final event: a consumer that
                    # stops at a finish_reason would otherwise never see the exception.
                    ready = [e for e in ready if e.finish_reason != "error"]
                yield from ready
                if failed is not None and failed.error is not None:
                    raise failed.error
        finally:
            with self.lock:
                for job in jobs:
                    if not job.done:
                        self._finish(job, "cancelled")

    def _stream_step(self, jobs: list[Job]) -> list[GenerationEvent]:
        """What a stream with no event pending does: step until one of its jobs has one."""
        with self.lock:
            ready = [e for job in jobs for e in self._drain(job)]
            if ready or all(job.done for job in jobs):
                return ready
            if not self._step(queue=True) and not self._running:
                self._stalled()
            return [e for job in jobs for e in self._drain(job)]

    def _on_step_thread(
        self, fn: Callable[[list[Job]], list[GenerationEvent]], jobs: list[Job]
    ) -> list[GenerationEvent]:
        """Run a streaming step on the scheduler's one step thread and wait for it.

        Streams are consumed from many threads (the API server runs each request in a
        thread of its own), and every thread that runs a forward gets its own cuBLAS handle
        with a 32 MiB workspace on Hopper that lives as long as the process: an H200 soak
        of 64 clients grew by 517 MiB that way. One thread runs every streaming step
        instead, so the workspaces are one. A caller that holds the engine lock (or is the
        step thread) runs it inline: the step thread would wait for that lock forever."""
        # RLock._is_owned is CPython's (threading.RLock's C type), missing from typeshed.
        owned = self.lock._is_owned()  # type: ignore[attr-defined]
        if threading.current_thread() is self._step_thread or owned:
            return fn(jobs)
        if self._stepper is None:
            with self.lock:
                if self._stepper is None:
                    self._stepper = ThreadPoolExecutor(1, thread_name_prefix="kestrel-step")
                    self._stepper.submit(self._remember_step_thread).result()
        return self._stepper.submit(fn, jobs).result()

    def _remember_step_thread(self) -> None:
        self._step_thread = threading.current_thread()

    # -- one step: plan = schedule(); output = runner.execute(plan); update(plan, output) --
    def _step(self, *, queue: bool) -> list[GenerationEvent]:
        """One step. With an execute in flight (a step's tokens drawn on the device and
        not read), its follow-up comes first: the next decode execute is launched from
        those tokens when nothing else is due, and only then are they read and taken into
        their jobs (`_continue`). Otherwise, or when that follow-up could not launch,
        a normal step runs."""
        if self._drawn is not None and all(job.done for job in self._drawn.jobs):
            self._drawn = None  # every job of it was cancelled: nothing to read
        events: list[GenerationEvent] = []
        read: list[Job] = []
        if self._drawn is not None:
            read = self._drawn.jobs
            events = self._continue(queue=queue)
            if self._drawn is not None:
                return events  # the next execute is in flight
        try:
            plan = self.schedule()
            busy = any(not self._idle(job) for job in self._running)
            if plan is None and (self._waiting or busy) and self._park_idle_sessions():
                # Idle sessions held the pages that the others need: freed, try again.
                plan = self.schedule()
                busy = any(not self._idle(job) for job in self._running)
            if plan is None:
                if busy:
                    self._unblock()
                return events
            rows: list[Row] = plan.rows
            lengths = [row.job.sequence.length for row in rows]
            try:
                output = self.runner.execute(plan)
            except (torch.OutOfMemoryError, MemoryError) as error:
                # One job ends (its final event is also queued); the others run again.
                return events + [self._out_of_memory(rows, lengths, error)]
            except BaseException as error:
                for row in rows:
                    row.job.error = error
                    self._finish(row.job, "error")
                raise
            events += self.update(plan, output, queue=queue)
            if self._in_flight():  # update left this step's tokens on the device
                events += self._continue(queue=queue)
            return events
        except BaseException:
            if not queue:  # the read step's events must not go down with this one
                requeue(events, read)
            raise

    def schedule(self) -> StepPlan | None:
        """The next step's plan (decode rows first, preempting the youngest jobs when the
        cache runs short; their drafts; then prefill chunks; then newly admitted jobs), or
        None when nothing can run. Pages for every row's tokens are within the free ones."""
        hidden = self._hidden_turn()
        rows = self._plan(hidden=hidden)
        if not rows:  # nothing of that kind can run now: the other kind may
            hidden = not hidden
            rows = self._plan(hidden=hidden)
        if not rows:
            return None
        self._last_hidden = hidden
        if hidden:
            return StepPlan(
                sequences=[row.job.sequence for row in rows],
                new_tokens=[row.feed for row in rows],
                loras=[row.job.loras for row in rows],
                hidden_states=True,
                rows=rows,
            )
        # Logits of each row's last token, unless a row wants more (the runner adds the
        # draft model's drafts to the counts when it proposes any).
        counts: list[int] | None = None
        if any(row.drafts or row.job.kind == LOGITS for row in rows):
            counts = [row.logits_wanted for row in rows]
        requests = None
        if any(row.draft_k for row in rows):
            requests = [
                DraftRequest(row.job.draft_sequence, row.job.tokens, row.draft_k)
                if row.draft_k
                else None
                for row in rows
            ]
        return StepPlan(
            sequences=[row.job.sequence for row in rows],
            new_tokens=[row.feed + row.drafts for row in rows],
            loras=[row.job.loras for row in rows],
            logits_counts=counts,
            drafts=requests,
            rows=rows,
        )

    def update(
        self, plan: StepPlan, output: StepOutput, *, queue: bool = False
    ) -> list[GenerationEvent]:
        """Take a step's output into its jobs: sample each row's tokens (per job: its
        sampler, its position's bans; speculative rows verify their drafts), advance the
        jobs (stops, detokenizing, banned-string rewinds, prefix pages) and return their
        events (`queue`: also queued on the jobs for their streams). A step whose rows all
        draw one token (`_drawable`) instead draws them on the device and leaves them in
        flight, unread: the next `_continue` reads them after launching the next execute."""
        rows: list[Row] = plan.rows
        if plan.hidden_states:
            return self._update_outputs(rows, output.values, queue=queue)
        logits = output.values
        batch = [row.job for row in rows]
        try:
            if output.drafts is not None:
                for row, drafts in zip(rows, output.drafts, strict=True):
                    row.drafts = drafts
            self._take_logits(rows, logits)
            if self._drawable(rows):
                self._drawn = draw_rows(
                    batch, logits, self.runner.apply_token_bitmask, self.runner.greedy_tokens
                )
                return []
            results = self._sample(rows, logits)
        except BaseException as error:
            for job in batch:
                job.error = error
                self._finish(job, "error")
            raise
        events = []
        for row, (tokens, logprobs) in zip(rows, results, strict=True):
            job = row.job
            if job.kind == SESSION:
                continue  # its logits were taken: the session's `feed` returns them
            if job.kind == LOGITS:
                if job.sequence.length == len(job.tokens):  # every position's logits taken
                    event = job.event("", [], "length", None)
                    self._finish(job, "length", emit=False)
                    events.append(event)
                    if queue:
                        job.events.append(event)
                continue
            advanced = self._advance(row.job, tokens, logprobs)
            if advanced is not None:
                events.append(advanced)
                if queue:
                    row.job.events.append(advanced)
        return events

    def _update_outputs(
        self, rows: list[Row], values: torch.Tensor, *, queue: bool
    ) -> list[GenerationEvent]:
        """A hidden-states step: each row's states [its tokens, hidden] go to its job;
        a job whose whole text is in ends."""
        events = []
        for row, part in zip(rows, values.split([len(r.feed) for r in rows]), strict=True):
            job = row.job
            job.outputs.append(part)
            if job.sequence.length == len(job.tokens):
                event = job.event("", [], "length", None)
                self._finish(job, "length", emit=False)
                events.append(event)
                if queue:
                    job.events.append(event)
        return events

    def _hidden_turn(self) -> bool:
        """Whether the next step is one of hidden jobs: when one is running or first in
        the queue, and nothing else is due or the last step was not one."""
        head = self._waiting[0].kind if self._waiting else None
        hidden_due = head == HIDDEN or any(job.kind == HIDDEN for job in self._running)
        if not hidden_due:
            return False
        other_due = (head is not None and head != HIDDEN) or any(
            job.kind != HIDDEN for job in self._running
        )
        return not (other_due and self._last_hidden)

    def _take_logits(self, rows: list[Row], logits: torch.Tensor) -> None:
        """A logits job's rows of this step, copied to the host; a session's last row once
        its piece is all in (left on the device, for its sampler)."""
        if not any(row.job.kind in (LOGITS, SESSION) for row in rows):
            return
        start = 0
        for row in rows:
            count = min(row.logits_wanted, len(row.feed) + len(row.drafts))
            job = row.job
            if job.kind == LOGITS and job.score_tokens:
                job.outputs.append(_piece_nll(job, logits[start : start + count]))
            elif job.kind == LOGITS:
                job.outputs.append(logits[start : start + count].float().cpu())
            elif job.kind == SESSION and job.sequence.length == len(job.tokens):
                job.outputs.append(logits[start + count - 1 : start + count].float())
            start += count

    # -- lookahead: one execute in flight (see the module docstring) --------------------
    def _drawable(self, rows: list[Row]) -> bool:
        """Whether the step's tokens may stay on the device: every row draws one token and
        nothing needs it on the host before the next forward."""
        return (
            self.lookahead
            and self.speculative is None
            and all(
                row.job.kind == GENERATE
                and not row.drafts
                and row.job.sequence.length == len(row.job.tokens)
                and row.job.sampling.logprobs_k is None
                for row in rows
            )
        )

    def _ahead(self, drawn: Drawn) -> list[int]:
        """Indices of the drawn jobs whose next decode forward can start before their
        tokens are read; [] when a normal step must come first (see the module docstring)."""
        if not self.lookahead or self.speculative is not None:
            return []
        if self._waiting and len(self._running) < self.max_batch:
            return []  # admit first
        live = [n for n, job in enumerate(drawn.jobs) if not job.done]
        if {drawn.jobs[n] for n in live} != set(self._running):
            return []  # another job needs a prompt chunk
        self._reserved = 0
        ahead = []
        for n in live:
            job = drawn.jobs[n]
            if job.loras:
                return []
            if len(job.generated_ids) + 1 >= job.max_new_tokens:
                continue  # the drawn token is its last
            need = self._pages_for(job, 1)
            if need > self._spare():
                return []  # a preemption is due: a normal step decides it
            self._reserved += need
            ahead.append(n)
        return ahead

    def _schedule_ahead(self, drawn: Drawn) -> StepPlan | None:
        """The plan of the decode step that follows `drawn`, fed its tokens on the device,
        or None when a normal step must come first."""
        ahead = self._ahead(drawn)
        if not ahead:
            return None
        jobs = [drawn.jobs[n] for n in ahead]
        tokens = drawn.tokens
        if len(ahead) < len(drawn.jobs):
            tokens = tokens[host_to_device(torch.tensor(ahead), tokens.device)]
        return StepPlan(
            sequences=[job.sequence for job in jobs],
            new_tokens=[[0] for _ in jobs],
            loras=[{} for _ in jobs],
            device_tokens=tokens,
            rows=ahead,
        )

    def _execute_ahead(self, plan: StepPlan) -> torch.Tensor | None:
        """Launch the lookahead plan's forward: its logits (still being computed), or None
        when it ran out of memory (a decode graph captured for a new batch size, or an
        eager step, allocates): then it is undone, the sequences back where they were, and
        a normal step follows, whose own handling ends at most one job."""
        lengths = [seq.length for seq in plan.sequences]
        try:
            logits = self.runner.execute(plan).values
        except (torch.OutOfMemoryError, MemoryError):
            for seq, length in zip(plan.sequences, lengths, strict=True):
                trim_sequence(self.pages, seq, length)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.lookahead_failed += 1
            return None
        self.lookahead_forwards += 1
        return logits

    def _continue(self, *, queue: bool) -> list[GenerationEvent]:
        """The in-flight step's follow-up: launch the next decode execute of the drawn jobs
        that can go on, then read the drawn tokens and take them into their jobs while the
        GPU computes; the jobs still valid after that draw their next tokens on the device
        from the new execute's logits (the next `step()` reads them).

        The host work between the launch and the draw (reading the tokens, stops,
        detokenizing, events: `_advance`) is where per-job work for the next sampling can
        overlap the in-flight forward."""
        drawn, self._drawn = self._drawn, None
        assert drawn is not None
        jobs = drawn.jobs
        ahead: list[int] = []
        try:
            logits = None
            plan = self._schedule_ahead(drawn)
            if plan is not None:
                logits = self._execute_ahead(plan)
                if logits is not None:
                    ahead = plan.rows
            sampled = drawn.readback.tolist()
        except BaseException as error:
            for job in jobs:
                if not job.done:
                    job.error = error
                    self._finish(job, "error")
            raise
        in_flight = {jobs[n] for n in ahead}
        events = []
        for job, token in zip(jobs, sampled, strict=True):
            if job.done:
                continue  # cancelled while its forward ran
            self._count_decode_row(job)
            event = self._advance(job, [token], [None], in_flight=int(job in in_flight))
            if event is not None:
                events.append(event)
                if queue:
                    job.events.append(event)
        if logits is not None:
            # A job that stopped or rewound drops its looked-ahead row (its cache slot went
            # with the finish or the rewind).
            keep = [
                i
                for i, n in enumerate(ahead)
                if not jobs[n].done and jobs[n].sequence.length == len(jobs[n].tokens)
            ]
            self.lookahead_dropped += len(ahead) - len(keep)
            if keep:
                going = [jobs[ahead[i]] for i in keep]
                if len(keep) < len(ahead):
                    logits = logits[host_to_device(torch.tensor(keep), logits.device)]
                try:
                    self._drawn = draw_rows(
                        going, logits, self.runner.apply_token_bitmask, self.runner.greedy_tokens
                    )
                except BaseException as error:
                    if not queue:  # the events made above must not be lost with the step
                        requeue(events, jobs)
                    for job in going:
                        job.error = error
                        self._finish(job, "error")
                    raise
        return events

    def _count_decode_row(self, job: Job) -> None:
        """stats()' tokens per decode step: one row of a decoding job, one token."""
        if job.state == DECODE:
            self._decode_rows += 1
            self._decode_tokens += 1

    # -- planning ------------------------------------------------------------------------
    def _plan(self, *, hidden: bool = False) -> list[Row]:
        """The rows of this step: decode tokens first (preempting the youngest jobs when the
        cache runs short), their drafts, then prefill chunks, then newly admitted jobs.
        `hidden`: a step of hidden jobs' chunks only (and of no other job's)."""
        self._reserved = 0
        rows: list[Row] = []
        for job in list(self._running):
            if hidden:
                break
            if job not in self._running or job.state != DECODE or self._to_feed(job) != 1:
                continue
            need = self._pages_for(job, 1)
            while need > self._spare() and self._running[-1] is not job:
                self._preempt(self._running[-1])
            if need > self._spare():
                self._preempt(job)
                continue
            self._reserved += need
            rows.append(Row(job, [job.tokens[-1]]))
        budget = self.max_tokens_per_step - len(rows)
        if self.speculative is not None and rows and len(rows) <= self.speculative_max_batch:
            budget -= self._draft(rows, budget)
        planned = {row.job for row in rows}
        for job in self._running:
            if budget <= 0:
                break
            if job not in planned and (job.kind == HIDDEN) == hidden:
                budget -= self._add_chunk(job, budget, rows)
        while self._waiting and budget > 0 and len(self._running) < self.max_batch:
            job = self._waiting[0]
            if (job.kind == HIDDEN) != hidden:
                break  # its turn comes with the next step of its kind
            if not self._admit(job):
                break  # first come, first served: later jobs do not overtake it
            self._waiting.popleft()
            self._running.append(job)
            budget -= self._add_chunk(job, budget, rows)
        return rows

    def _out_of_memory(
        self, rows: list[Row], lengths: list[int], error: BaseException
    ) -> GenerationEvent:
        """A forward ran out of memory: end one job of the step with "error" (the one that
        fed the most tokens, its prefill chunk being the likely cause; the youngest among
        equals), free its pages, and undo the step for the others, which run again on the
        next step. Nothing was sampled yet, so their samplers and outputs are untouched;
        only their sequences advanced (ForwardBatch.build) and are trimmed back."""
        order = {job: n for n, job in enumerate(self._running)}
        culprit = max(
            range(len(rows)),
            key=lambda n: (
                len(rows[n].feed) + len(rows[n].drafts) + rows[n].draft_k,
                order.get(rows[n].job, -1),
            ),
        )
        tokens = sum(len(row.feed) + len(row.drafts) for row in rows)
        for n, (row, length) in enumerate(zip(rows, lengths, strict=True)):
            if row.chunk:
                row.job.prefill_tokens -= len(row.feed)
            if n != culprit:
                trim_sequence(self.pages, row.job.sequence, length)
        job = rows[culprit].job
        first_line = (str(error) or type(error).__name__).splitlines()[0]
        job.error = GenerationMemoryError(
            f"job {job.id} ran out of memory in a step of {tokens} tokens over {len(rows)} "
            f"jobs ({type(error).__name__}: {first_line}); it was stopped and its cache pages "
            "freed, the other jobs go on. A shorter prompt, fewer new tokens, or a smaller "
            "prefill_chunk or max_batch at load time avoid it"
        )
        self._finish(job, "error")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the failed step's blocks back before the next
        return job.events[-1]

    def _to_feed(self, job: Job) -> int:
        return len(job.tokens) - job.sequence.length

    def _pages_for(self, job: Job, count: int) -> int:
        """Pages `job` must add to hold `count` more tokens."""
        page_size = self.pages.page_size
        return max(0, -(-(job.sequence.length + count) // page_size) - len(job.sequence.pages))

    def _spare(self) -> int:
        return self.pages.free_pages - self._reserved

    def _add_chunk(self, job: Job, budget: int, rows: list[Row]) -> int:
        """A prefill chunk of `job` (its prompt, or tokens to compute again after a
        preemption or a rewind), as long as budget and free pages allow."""
        seq = job.sequence
        page_size = self.pages.page_size
        fits = (len(seq.pages) + self._spare()) * page_size - seq.length
        count = min(budget, self._to_feed(job), fits)
        if count <= 0:
            return 0
        self._reserved += self._pages_for(job, count)
        rows.append(Row(job, job.tokens[seq.length : seq.length + count], chunk=True))
        job.prefill_tokens += count
        return count

    def _draft(self, rows: list[Row], budget: int) -> int:
        """Drafts for decode rows whose sampler allows them, within the token budget and
        the free pages; returns the tokens they may add to the step. N-gram drafts are
        proposed here (host only); the draft model's are asked of the runner (`draft_k`),
        which proposes them inside `execute`, before the target's forward."""
        wanted: list[tuple[Row, int]] = []
        page_size = self.pages.page_size
        for row in rows:
            job = row.job
            if not job.speculate:
                continue
            # The token after the drafts is always produced: never draft past the end.
            room = job.max_new_tokens - len(job.generated_ids) - 1
            seq = job.sequence
            fits = (len(seq.pages) + self._spare()) * page_size - seq.length - 1
            k = min(self.num_draft_tokens, room, budget, fits)
            if k <= 0:
                continue
            self._reserved += self._pages_for(job, 1 + k) - self._pages_for(job, 1)
            budget -= k
            wanted.append((row, k))
        used = 0
        for row, k in wanted:
            if self.draft_pages is not None:
                row.draft_k = k
                used += k
            else:
                assert row.job.drafter is not None
                row.drafts = trim_drafts(row.job, list(row.job.drafter.propose(row.job.tokens, k)))
                used += len(row.drafts)
        return used

    def _admit(self, job: Job) -> bool:
        """Admit `job` when its prompt fits the free pages, with one page to spare for
        each running job's next page (so an admission does not cause a preemption at once).
        Jobs are not reserved their whole output: when decode runs out of pages, the
        youngest job is preempted (`_plan`)."""
        cache = self.pages
        page_size = cache.page_size
        pages: list[int] = []
        if self.prefix_caching and job.kind == GENERATE:
            max_pages = (len(job.tokens) - 1) // page_size
            pages = find_prefix(cache, job.chain, job.tokens, max_pages)
        # Adopting a page that only the LRU holds uses up a free page; one that another job
        # holds does not.
        held_elsewhere = sum(cache.refcount(p) > 0 for p in pages)
        need = -(-len(job.tokens) // page_size) - held_elsewhere
        if need + len(self._running) > self._spare():
            return False
        job.cached_tokens = max(job.cached_tokens, adopt(cache, job.sequence, pages))
        job.published = len(pages)
        job.state = PREFILL
        if job.admitted is None:
            job.admitted = time.perf_counter()
        return True

    def _in_flight(self) -> bool:
        """Whether a step's tokens are drawn on the device and not read yet (`Drawn`)."""
        return self._drawn is not None

    def _idle(self, job: Job) -> bool:
        """A session between two pieces: it holds pages and has nothing to compute."""
        return job.kind == SESSION and self._to_feed(job) == 0

    def _park_idle_sessions(self) -> bool:
        """Free the pages of every idle session (each computes its tokens again with its
        next piece); whether there was one."""
        idle = [job for job in self._running if self._idle(job)]
        for job in idle:
            self._preempt(job)
        return bool(idle)

    def _preempt(self, job: Job) -> None:
        """Free a running job's pages and queue it first among the waiting: it computes its
        tokens again when admitted (its prefix-cached pages may still be there). Sampling
        state, output and events are kept, so its output is as if it had never stopped.
        An idle session is parked instead: it waits for its next piece in no queue."""
        parked = self._idle(job)
        self._running.remove(job)
        job.sequence.release(self.pages)
        if self.draft_pages is not None:
            job.draft_sequence.release(self.draft_pages)
        job.outputs.clear()  # a logits or hidden job computes its prompt again
        job.state = WAITING
        job.published = 0
        job.preemptions += 1
        self.preemptions += 1
        if not parked:
            self._waiting.appendleft(job)

    def _unblock(self) -> None:
        """Nothing could run although jobs are admitted: their partial prefills hold the
        pages the oldest needs. Preempt the youngest; a lone job that cannot go on means
        pages are held outside the scheduler."""
        if len(self._running) > 1:
            self._preempt(self._running[-1])
            return
        job = self._running[0]
        raise SchedulerError(
            f"job {job.id} needs more pages and nothing else runs, but only "
            f"{self.pages.free_pages} of {self.usable_pages} are free: pages are held "
            "outside the scheduler"
        )

    def _stalled(self) -> None:
        # A job that fits the empty cache is admitted when nothing else runs (idle sessions
        # are parked first): this means pages are held outside the scheduler.
        job = self._waiting[0]
        need = -(-len(job.tokens) // self.pages.page_size)
        raise SchedulerError(
            f"job {job.id} needs {need} pages and nothing runs, but only "
            f"{self.pages.free_pages} of {self.usable_pages} are free: pages are held "
            "outside the scheduler"
        )

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> list[RowTokens]:
        """Each row's new tokens (engine/row_sampling.py), counted in `stats()`."""
        results, counts = sample_rows(
            rows, logits, self.runner.apply_token_bitmask, self.runner.greedy_tokens
        )
        self._decode_rows += counts.decode_rows
        self._decode_tokens += counts.decode_tokens
        self._drafted += counts.drafted
        self._accepted += counts.accepted
        return results

    def _advance(
        self,
        job: Job,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        *,
        in_flight: int = 0,
    ) -> GenerationEvent | None:
        """Take a row's new tokens into its job: rewind rejected drafts' cache entries,
        publish full pages, then feed the output one token at a time (a stop ends the job
        there; a banned string rewinds it). `in_flight`: a lookahead forward already
        feeds the last of `tokens` (its cache slot is taken)."""
        cache = self.pages
        if not tokens:
            self._publish(job, job.tokens)
            return None
        ended = sync_constraint(job, job.generated_ids)
        if ended is not None:
            # Its grammar allowed no token at this position (broken, or complete with EOS
            # banned): the token drawn is not used.
            self._finish(job, ended)
            return job.events.pop()
        if job.state == PREFILL:
            job.state = DECODE
            if job.first_token is None:
                job.first_token = time.perf_counter()
        # The cache keeps every token but the last one sampled (unless a lookahead forward
        # already writes that one).
        keep = len(job.tokens) + len(tokens) - 1 + in_flight
        if job.sequence.length > keep:
            trim_sequence(cache, job.sequence, keep)
        if self.draft_pages is not None and job.draft_sequence.length > keep:
            trim_sequence(self.draft_pages, job.draft_sequence, keep)
        self._publish(job, job.tokens + tokens)
        text, ids, lps, reason = "", [], [], None
        for token, lp in zip(tokens, logprobs, strict=True):
            job.tokens.append(token)
            job.held_logprobs.append(lp)
            fed = job.output.feed_token(token)
            if fed.rewind is not None:
                self._rewind(job, fed.rewind, fed.banned_token)
                break
            start = job.output.final - len(fed.token_ids)
            text += fed.text
            ids += fed.token_ids
            lps += job.held_logprobs[start : job.output.final]
            if fed.finish_reason is not None:
                reason = fed.finish_reason
                self._finish(job, reason, emit=False)
                break
        if not job.done:
            ended = sync_constraint(job, job.generated_ids)
            if ended is not None:
                reason = ended
                self._finish(job, reason, emit=False)
        if not (text or ids or reason):
            return None
        wanted = job.sampling.logprobs_k is not None
        return job.event(text, ids, reason, [x for x in lps if x is not None] if wanted else None)

    def _publish(self, job: Job, tokens: list[int]) -> None:
        if self.prefix_caching and job.kind == GENERATE:
            job.published = publish(self.pages, job.sequence, job.chain, tokens, job.published)

    def _rewind(self, job: Job, index: int, banned: int | None) -> None:
        """A banned string began in generated token `index`: go back to before it, ban it
        there, and let the next step sample that position again."""
        keep = len(job.prompt_ids) + index
        del job.tokens[keep:]
        del job.held_logprobs[index:]
        job.bans.rewind(index, banned)
        job.sampling.truncate(keep)
        cache = self.pages
        trim_sequence(cache, job.sequence, keep - 1)
        page_size = cache.page_size
        job.published = min(job.published, job.sequence.length // page_size)
        # Chain hashes of pages that held dropped tokens no longer describe the job.
        del job.chain.hashes[keep // page_size :]
        if job.drafter is not None:
            job.drafter.rewind(keep)
        if self.draft_pages is not None:
            trim_sequence(self.draft_pages, job.draft_sequence, keep - 1)
        self.rewinds += 1

    # -- finishing -----------------------------------------------------------------------
    def _finish(self, job: Job, reason: str, *, emit: bool = True) -> None:
        if job in self._running:
            self._running.remove(job)
        elif job in self._waiting:
            self._waiting.remove(job)
        job.sequence.release(self.pages)
        if self.draft_pages is not None:
            job.draft_sequence.release(self.draft_pages)
        if job.lora_held:
            job.lora_held = False
            self.loras.release(job.loras)  # may free an adapter waiting to unload
        job.state = FINISHED
        job.finish_reason = reason
        if emit:
            job.events.append(job.event("", [], reason, None))

    def _drain(self, job: Job) -> list[GenerationEvent]:
        events = list(job.events)
        job.events.clear()
        return events


def _piece_nll(job: Job, logits: torch.Tensor) -> torch.Tensor:
    """[Σ NLL, count] (float64, CPU) of the tokens that the logits of a logits job's piece
    (the last len(logits) positions its sequence holds now) predict: the next token of each
    position, the sequence's last position predicting none."""
    first = job.sequence.length - logits.shape[0]
    targets = job.tokens[first + 1 : first + 1 + logits.shape[0]]
    if not targets:
        return torch.zeros(2, dtype=torch.float64)
    target = torch.tensor(targets, dtype=torch.long).to(logits.device, non_blocking=True)
    nll = F.cross_entropy(logits[: len(targets)].float(), target, reduction="sum")
    return torch.tensor([float(nll), len(targets)], dtype=torch.float64)
