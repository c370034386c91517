"""The scheduler's lookahead: launch the next decode forward before reading the tokens
of the last one (engine/scheduler.py's contract, "Lookahead", says what a client sees).

A decode step of one job is ~2.5 ms of GPU work on an 8B model; reading its tokens back,
detokenizing, checking stops and building events took another ~0.7 ms on the host, during
which the GPU waited. Here the step's tokens stay on the device (`Scheduler._draw`), their
copy to pinned host memory is queued right behind the sampler (`TokenReadback`), and the
next step first launches its forward with those tokens as input
(`Engine.forward_decode_tokens`: device to device into the decode graph's token column),
then waits for that copy alone and does the host work while the GPU computes.

The forward runs one token ahead of what the host knows, so:
- a job's cache holds its last drawn token too (`_advance(..., in_flight=1)` keeps it);
- a job that stops at the token being read (end of text, a stop string) or rewinds for a
  banned string has its looked-ahead row dropped, with its cache slot (the finish frees
  the pages; the rewind trims past it); a job whose drawn token is its last
  (max_new_tokens) is not looked ahead at all;
- a lookahead forward that runs out of memory is undone (the sequences trimmed back) and
  the normal step that follows handles the shortage as any step does;
- anything the host must decide first ends the lookahead for one step: a job waiting for
  admission with room in the batch, a job that would need a preemption for its next page,
  a prompt chunk, LoRA, speculation, logprobs. The drawn tokens are then read and a normal
  step follows in the same `step()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.generator import GenerationEvent, TokenReadback
from engine.rewind import trim_sequence
from engine.samplers.batched import host_to_device

if TYPE_CHECKING:
    from engine.scheduler import Job


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


class LookaheadSteps:
    """The lookahead half of `engine.scheduler.Scheduler` (mixed into it): it uses the
    scheduler's queues, page accounting, `_draw`, `_advance`, `_finish` and
    `_count_decode_row`."""

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

    def _read_drawn(self, *, queue: bool) -> list[GenerationEvent]:
        """Launch the next decode forward of the drawn jobs that can go on, then read the
        drawn tokens and take them into their jobs; the jobs still valid after that draw
        their next tokens on the device (the next `step()` reads them)."""
        drawn, self._drawn = self._drawn, None
        assert drawn is not None
        ahead = self._ahead(drawn)
        jobs = drawn.jobs
        try:
            logits = None
            if ahead:
                logits = self._launch_ahead(drawn, ahead)
                if logits is None:
                    ahead = []
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
                    self._drawn = self._draw(going, logits)
                except BaseException as error:
                    if not queue:  # the events made above must not be lost with the step
                        requeue(events, jobs)
                    for job in going:
                        job.error = error
                        self._finish(job, "error")
                    raise
        return events

    def _launch_ahead(self, drawn: Drawn, ahead: list[int]) -> torch.Tensor | None:
        """The decode forward of drawn jobs `ahead`, fed their drawn tokens on the device:
        its logits, or None when it ran out of memory (a decode graph captured for a new
        batch size, or an eager step, allocates): then it is undone, the sequences back
        where they were, and a normal step follows, whose own handling ends at most one job."""
        jobs = [drawn.jobs[n] for n in ahead]
        lengths = [job.sequence.length for job in jobs]
        tokens = drawn.tokens
        if len(ahead) < len(drawn.jobs):
            tokens = tokens[host_to_device(torch.tensor(ahead), tokens.device)]
        try:
            logits = self.engine.forward_decode_tokens([job.sequence for job in jobs], tokens)
        except (torch.OutOfMemoryError, MemoryError):
            for job, length in zip(jobs, lengths, strict=True):
                trim_sequence(self.engine.cache, job.sequence, length)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.lookahead_failed += 1
            return None
        self.lookahead_forwards += 1
        return logits
