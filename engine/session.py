"""A session: one sequence fed from outside, a piece at a time, through the scheduler.

`Scheduler.open_session()` gives one. It is the single-job loop's `DecodeSession`
(engine/generate.py's `generate_single`, the reference that tests hold the batched
scheduler to): `prefill(ids)` and `step(id)` feed tokens and return the last one's
logits; `close()` frees its cache. Each piece is a session job's turn in the scheduler's
next steps (engine/jobs.py), batched with whatever else runs, with its pages in the
scheduler's books: between pieces it keeps them, and when others need them it gives them
up and computes its tokens again on its next piece, as a preempted job does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from engine.jobs import Job


class SessionFeeds(Protocol):
    """What a session needs of the scheduler."""

    def feed(self, job: Job, tokens: Iterable[int]) -> torch.Tensor: ...
    def cancel(self, job: Job) -> None: ...


class EngineSession:
    def __init__(self, scheduler: SessionFeeds, job: Job) -> None:
        self.scheduler = scheduler
        self.job = job

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Feed `token_ids`; the last one's logits [vocab] (float32, logits device)."""
        return self.scheduler.feed(self.job, token_ids)

    def step(self, token_id: int) -> torch.Tensor:
        return self.scheduler.feed(self.job, [token_id])

    def close(self) -> None:
        self.scheduler.cancel(self.job)
