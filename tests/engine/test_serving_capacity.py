"""Capacity and memory faults while serving, on a tiny random Llama with a small cache (CPU).

- A prompt longer than the cache is refused at submit; asking for more new tokens than the
  cache holds is clamped (finish_reason "length"); more jobs than `max_batch`, or than the
  cache holds at once, wait or are preempted and all finish with the tokens they would have
  produced alone.
- Out of memory inside a forward (torch.OutOfMemoryError / MemoryError raised by the real
  model's forward, once, while other jobs run): only one job fails, with a message that says
  what happened, its pages are freed, and the others finish with unchanged tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.cache import CacheFullError
from engine.engine import Engine, EngineOptions
from engine.generate import generate_single
from engine.scheduler import GenerationMemoryError
from helpers.model_factory import make_tiny_llama

GREEDY = {"temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-capacity")
    make_tiny_llama(path)
    return path


def _engine(path: Path, **options) -> Engine:
    base = dict(
        device="cpu", dtype="float32", max_seq_len=256, page_size=8, cache_tokens=128,
        prefill_chunk=32, max_batch=3,
    )  # fmt: skip
    return Engine.load(path, EngineOptions(**{**base, **options}))


def _prompt(n: int, start: int) -> list[int]:
    return [3 + (start + 7 * i) % 380 for i in range(n)]


def _alone(engine: Engine, prompt: list[int], new: int) -> list[int]:
    events = generate_single(engine, prompt, {**GREEDY, "max_new_tokens": new})
    return [t for e in events for t in e.token_ids]


def _run_all(engine: Engine, jobs: list) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {job.id: [] for job in jobs}
    for event in engine.scheduler.stream_many(jobs):
        out[event.job_id] += event.token_ids
    return out


def _idle(engine: Engine) -> None:
    stats = engine.scheduler.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["free_pages"] == stats["usable_pages"], stats


def test_requests_beyond_the_cache_are_refused_or_clamped(model_dir: Path) -> None:
    engine = _engine(model_dir)
    sched = engine.scheduler
    with pytest.raises(CacheFullError, match="129 tokens; the KV cache holds 128"):
        sched.submit(_prompt(129, 0), GREEDY)
    # prompt + max_new_tokens beyond the cache: clamped to what the cache holds
    job = sched.submit(_prompt(100, 1), {**GREEDY, "max_new_tokens": 10_000})
    tokens = _run_all(engine, [job])[job.id]
    assert job.finish_reason == "length" and len(tokens) == 128 - 100 + 1
    _idle(engine)


def test_more_jobs_than_batch_and_cache_all_finish(model_dir: Path) -> None:
    engine = _engine(model_dir)
    prompts = [_prompt(20 + 3 * i, i) for i in range(7)]  # 7 jobs, max_batch 3
    expected = [_alone(engine, p, 40) for p in prompts]
    jobs = [engine.scheduler.submit(p, {**GREEDY, "max_new_tokens": 40}) for p in prompts]
    out = _run_all(engine, jobs)
    # 3 jobs of ~25 + 40 tokens need more than the 128-token cache: some were preempted
    assert engine.scheduler.preemptions > 0
    assert [out[j.id] for j in jobs] == expected
    _idle(engine)


class _FailOnce:
    """Wraps the real model's forward: raises `error` on the call where `when(batch)` holds
    first, then runs normally (the fault a too-large step meets on a GPU)."""

    def __init__(self, forward: Callable, error: BaseException, when: Callable) -> None:
        self.forward, self.error, self.when, self.raised = forward, error, when, False

    def __call__(self, batch, cache):
        if not self.raised and self.when(batch):
            self.raised = True
            raise self.error
        return self.forward(batch, cache)


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), MemoryError()],
    ids=["cuda-oom", "memory-error"],
)
def test_out_of_memory_in_a_forward_fails_only_one_job(model_dir: Path, error) -> None:
    engine = _engine(model_dir, cache_tokens=256, max_batch=4)
    small = [_prompt(5, i) for i in range(3)]
    big = _prompt(30, 9)  # its prefill chunk is the step's largest row
    expected = [_alone(engine, p, 12) for p in small]
    sched = engine.scheduler
    jobs = [sched.submit(p, {**GREEDY, "max_new_tokens": 12}) for p in small]
    # Let the small jobs prefill and decode a few tokens before the big one arrives.
    out: dict[int, list[int]] = {j.id: [] for j in jobs}
    for _ in range(4):
        for event in sched.step():
            out[event.job_id] += event.token_ids
    free_before = engine.cache.free_pages
    victim = sched.submit(big, {**GREEDY, "max_new_tokens": 12})
    model = engine.model
    model.forward = _FailOnce(model.forward, error, lambda b: b.token_ids.numel() > 20)
    try:
        events = sched.step()  # the step with the big prefill chunk: out of memory
    finally:
        del model.forward
    assert victim.finish_reason == "error" and isinstance(victim.error, GenerationMemoryError)
    # The step first delivered the small jobs' tokens drawn by the step before (the
    # scheduler's lookahead reads them then); the failed forward made one event only.
    assert [e.job_id for e in events if e.finish_reason == "error"] == [victim.id]
    for event in events:
        if event.job_id != victim.id:
            assert event.finish_reason is None
            out[event.job_id] += event.token_ids
    message = str(victim.error)
    assert f"job {victim.id} ran out of memory" in message and "pages freed" in message
    assert type(error).__name__ in message
    assert victim.sequence.pages == [] and engine.cache.free_pages == free_before
    assert all(j.finish_reason is None for j in jobs)
    for event in sched.stream_many(jobs):
        out[event.job_id] += event.token_ids
    assert [out[j.id] for j in jobs] == expected  # the undone step changed nothing
    _idle(engine)
    # the scheduler serves the same request again once memory allows
    again = sched.submit(big, {**GREEDY, "max_new_tokens": 12})
    assert _run_all(engine, [again])[again.id] == _alone(engine, big, 12)


def test_out_of_memory_reaches_the_stream_of_its_job(model_dir: Path) -> None:
    engine = _engine(model_dir)
    sched = engine.scheduler
    job = sched.submit(_prompt(10, 3), {**GREEDY, "max_new_tokens": 8})
    model = engine.model
    model.forward = _FailOnce(model.forward, torch.OutOfMemoryError("oom"), lambda b: True)
    try:
        with pytest.raises(GenerationMemoryError, match="ran out of memory"):
            list(sched.stream(job))
    finally:
        del model.forward
    _idle(engine)
