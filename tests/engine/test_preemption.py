"""Preemption under a deliberately tiny KV cache (engine/scheduler.py), on the CPU: every
job completes, with output identical to a run with room to spare, and the pages come back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.cache import CacheFullError
from engine.engine import Engine, EngineOptions
from helpers.model_factory import make_tiny_llama

GREEDY = {"temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-preempt")
    make_tiny_llama(path)
    return path


def _engine(path: Path, cache_tokens: int, **options) -> Engine:
    base = dict(
        device="cpu",
        dtype="float32",
        max_seq_len=256,
        page_size=8,
        cache_tokens=cache_tokens,
        prefill_chunk=16,
        max_batch=8,
    )
    return Engine.load(path, EngineOptions(**{**base, **options}))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


PROMPTS = [_prompt(n, seed=n) for n in (10, 6, 13, 9)]
SETTINGS = [
    {**GREEDY, "max_new_tokens": 18},
    {"max_new_tokens": 18, "temperature": 0.9, "top_p": 0.9, "seed": 4},
    {**GREEDY, "max_new_tokens": 18, "repetition_penalty": 1.2},
    {"max_new_tokens": 18, "temperature": 1.1, "min_p": 0.05, "seed": 9},
]


def _run(engine: Engine) -> list[list[int]]:
    sched = engine.scheduler
    jobs = [sched.submit(p, s) for p, s in zip(PROMPTS, SETTINGS, strict=True)]
    out: dict[int, list[int]] = {job.id: [] for job in jobs}
    for event in sched.stream_many(jobs):
        out[event.job_id] += event.token_ids
    assert all(job.finish_reason == "length" for job in jobs)
    return [out[job.id] for job in jobs]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    engine = _engine(model_dir, cache_tokens=1024)
    ref = _run(engine)
    assert engine.scheduler.stats()["preemptions"] == 0
    return ref


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_tiny_cache_preempts_and_matches(model_dir: Path, reference, speculative):
    # 5 pages of 8 tokens: each job alone needs up to 4 (prompt + 17 tokens), so four
    # jobs admitted on their prompts run out while decoding.
    engine = _engine(model_dir, cache_tokens=40, speculative=speculative)
    got = _run(engine)
    if speculative is None:
        assert got == reference
    else:
        # Sampled jobs draw their tokens by the acceptance rule (same distribution, other
        # draws); greedy ones must not change by a token.
        assert [got[0], got[2]] == [reference[0], reference[2]]
    stats = engine.scheduler.stats()
    assert stats["preemptions"] > 0 and stats["running"] == stats["waiting"] == 0
    assert engine.cache.free_pages == engine.cache.num_pages


def test_never_fitting_prompt_is_refused(model_dir: Path):
    engine = _engine(model_dir, cache_tokens=40)
    with pytest.raises(CacheFullError, match="41 tokens; the KV cache holds 40"):
        engine.scheduler.submit(_prompt(41, seed=0), GREEDY)
    # a prompt that fits with no room for its output is clamped to the cache, not refused
    job = engine.scheduler.submit(_prompt(36, seed=0), {**GREEDY, "max_new_tokens": 20})
    assert job.max_new_tokens == 5
