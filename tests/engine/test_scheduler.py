"""Continuous batching (engine/scheduler.py) on a tiny random Llama, on the CPU.

The reference is the single-job loop `generate_single` over an `EngineSession`: batching,
chunked prefill and admission order must not change a single token (greedy, or seeded).
"""

from __future__ import annotations

import gc
import random
import threading
import weakref
from pathlib import Path

import pytest
import torch

import loader
from engine.cache import CacheFullError, Sequence
from engine.engine import ContextLengthError, Engine, EngineOptions
from engine.generate import generate, generate_single
from engine.generator import GenerationEvent
from engine.scheduler import DECODE, PREFILL, QueueFullError, SchedulerError
from helpers.model_factory import make_tiny_llama

GREEDY = {"temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path)
    return path


def _engine(path: Path, **options) -> Engine:
    base = dict(
        device="cpu",
        dtype="float32",
        max_seq_len=256,
        page_size=8,
        cache_tokens=512,
        prefill_chunk=16,  # the step's token budget: long prompts are prefilled in chunks
        max_batch=8,
    )
    return Engine.load(path, EngineOptions(**{**base, **options}))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


PROMPTS = [_prompt(n, seed=n) for n in (3, 9, 17, 24, 33, 41, 50, 64)]


def _single(engine: Engine, prompt: list[int], settings: dict) -> tuple[list[int], str]:
    events = list(generate_single(engine, prompt, settings))
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events)


def _collect(events: list[GenerationEvent]) -> dict[int, list[GenerationEvent]]:
    by_job: dict[int, list[GenerationEvent]] = {}
    for e in events:
        by_job.setdefault(e.job_id, []).append(e)
    return by_job


def _ids(events: list[GenerationEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_batched_equals_single_greedy(model_dir: Path):
    engine = _engine(model_dir)
    settings = {**GREEDY, "max_new_tokens": 6}
    ref = [_single(engine, p, settings) for p in PROMPTS]
    free = engine.cache.free_pages
    sched = engine.scheduler
    jobs = [sched.submit(p, settings) for p in PROMPTS[:5]]
    events = sched.step() + sched.step()
    # continuous batching: jobs join while others prefill and decode
    jobs += [sched.submit(p, settings) for p in PROMPTS[5:]]
    events += list(sched.stream_many(jobs))
    by_job = _collect(events)
    for job, (ids, text) in zip(jobs, ref, strict=True):
        assert _ids(by_job[job.id]) == ids == job.generated_ids
        assert "".join(e.text for e in by_job[job.id]) == text
        assert job.finish_reason == "length" and by_job[job.id][-1].finish_reason == "length"
    assert engine.cache.free_pages == free
    # the public single-job path runs on the scheduler and agrees too
    assert _ids(list(generate(engine, PROMPTS[6], settings))) == ref[6][0]


@pytest.mark.parametrize(
    ("settings", "argmaxes_per_token"),
    [
        ({"temperature": 0, "max_new_tokens": 5}, 1),  # plain greedy: no ban, no bias
        # Greedy with a ban (as tools/bench.py runs) and a seeded draw come through
        # sample_batched: its best allowed token, and for a draw the noisy argmax too.
        ({"temperature": 0, "max_new_tokens": 5, "ban_eos_token": True}, 1),
        ({"temperature": 0.8, "top_k": 20, "max_new_tokens": 5, "seed": 7}, 2),
    ],
    ids=["plain-greedy", "greedy-ban-eos", "seeded-draw"],
)
def test_rows_draw_through_the_runners_argmax(
    model_dir: Path, monkeypatch, settings: dict, argmaxes_per_token: int
):
    """The scheduler's rows take the runner's `greedy_tokens` (kernels/argmax.py on a GPU;
    here its Triton kernels run in the interpreter) for every argmax of a draw, in the
    lookahead draw and the plain one, and give the single-job loop's tokens (torch's argmax)."""
    from kernels.argmax import argmax_rows

    engine = _engine(model_dir)
    ref = [_single(engine, p, settings)[0] for p in PROMPTS[:4]]
    rows_seen: list[int] = []

    def through_the_kernel(logits: torch.Tensor) -> torch.Tensor:
        rows_seen.append(logits.shape[0])
        return argmax_rows(logits, backend="triton")

    monkeypatch.setattr(engine.runner, "greedy_tokens", through_the_kernel)
    sched = engine.scheduler
    jobs = [sched.submit(p, settings) for p in PROMPTS[:4]]
    by_job = _collect(list(sched.stream_many(jobs)))
    assert [_ids(by_job[job.id]) for job in jobs] == ref
    # Every token of every job came from it (rows of a step drawn together).
    assert sum(rows_seen) == argmaxes_per_token * sum(len(ids) for ids in ref)


def test_batched_equals_single_seeded_sampling(model_dir: Path):
    engine = _engine(model_dir)
    settings = [
        {"max_new_tokens": 10, "temperature": 0.9, "top_k": 40, "seed": 11},
        {"max_new_tokens": 10, "temperature": 1.3, "top_p": 0.9, "seed": 12},
        {"max_new_tokens": 10, "repetition_penalty": 1.3, "temperature": 0, "seed": 13},
        {"max_new_tokens": 10, "min_p": 0.05, "presence_penalty": 0.5, "seed": 14},
    ]
    prompts = PROMPTS[1:5]
    ref = [_single(engine, p, s)[0] for p, s in zip(prompts, settings, strict=True)]
    jobs = [engine.scheduler.submit(p, s) for p, s in zip(prompts, settings, strict=True)]
    by_job = _collect(list(engine.scheduler.stream_many(jobs)))
    assert [_ids(by_job[j.id]) for j in jobs] == ref


def test_stop_strings_never_leak_across_events(model_dir: Path):
    engine = _engine(model_dir)
    settings = {**GREEDY, "max_new_tokens": 24}
    ids, full = _single(engine, PROMPTS[2], settings)
    start = len(full) // 2
    stop = full[start : start + 3]
    assert "\ufffd" not in stop and full.find(stop) > 0
    expected = full[: full.find(stop)]
    sched = engine.scheduler
    others = [sched.submit(p, settings) for p in (PROMPTS[0], PROMPTS[7])]
    job = sched.submit(PROMPTS[2], {**settings, "stop": [stop, "never appears"]})
    by_job = _collect(list(sched.stream_many([job, *others])))
    texts = [e.text for e in by_job[job.id]]
    assert "".join(texts) == expected and job.finish_reason == "stop"
    # not even the start of the stop string was emitted on its own
    assert all(stop not in t for t in texts)
    # a stop token id ends the job on that token
    k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), 0)
    job = sched.submit(PROMPTS[2], {**settings, "stop_token_ids": [ids[k]]})
    events = list(sched.stream(job))
    assert _ids(events) == ids[: k + 1] and events[-1].finish_reason == "stop"


def test_cancel_frees_pages_at_once(model_dir: Path):
    engine = _engine(model_dir, max_batch=2)
    sched = engine.scheduler
    free = engine.cache.free_pages
    settings = {**GREEDY, "max_new_tokens": 8}
    # while the prompt is still being prefilled
    long_job = sched.submit(PROMPTS[7], settings)
    sched.step()
    assert long_job.state == PREFILL and engine.cache.free_pages < free
    sched.cancel(long_job)
    assert engine.cache.free_pages == free and long_job.finish_reason == "cancelled"
    assert long_job.events[-1].finish_reason == "cancelled"
    # while decoding, with another job waiting behind a full batch
    a, b = sched.submit(PROMPTS[0], settings), sched.submit(PROMPTS[1], settings)
    waiting = sched.submit(PROMPTS[2], settings)
    while a.state != DECODE:
        sched.step()
    assert sched.num_running == 2 and sched.num_waiting == 1
    sched.cancel(waiting)
    assert sched.num_waiting == 0 and waiting.finish_reason == "cancelled"
    sched.cancel(a)
    sched.cancel(b)
    assert engine.cache.free_pages == free and sched.num_running == 0
    # closing a stream cancels its job
    job = sched.submit(PROMPTS[3], settings)
    stream = sched.stream(job)
    next(stream)
    stream.close()
    assert job.finish_reason == "cancelled" and engine.cache.free_pages == free
    sched.cancel(job)  # cancelling a finished job changes nothing
    assert job.finish_reason == "cancelled"


def test_full_cache_queues_jobs(model_dir: Path):
    # 6 pages of 8 tokens; each job may need 20 + 12 - 1 tokens, i.e. 4 pages
    engine = _engine(model_dir, cache_tokens=48)
    sched = engine.scheduler
    settings = {**GREEDY, "max_new_tokens": 12}
    prompts = [_prompt(20, seed=s) for s in range(3)]
    ref = [_single(engine, p, settings)[0] for p in prompts]
    jobs = [sched.submit(p, settings) for p in prompts]
    sched.step()
    assert sched.num_running == 1 and sched.num_waiting == 2
    by_job = _collect(list(sched.stream_many(jobs)))
    assert [_ids(by_job[j.id]) for j in jobs] == ref
    assert all(j.finish_reason == "length" for j in jobs)
    assert by_job[jobs[2].id][-1].queue_seconds > 0
    # a prompt the whole cache cannot hold is refused; generation is clamped to the cache
    with pytest.raises(CacheFullError, match="50 tokens; the KV cache holds 48"):
        sched.submit(_prompt(50, seed=1), settings)
    job = sched.submit(_prompt(40, seed=1), {**GREEDY, "max_new_tokens": 100})
    assert len(_ids(list(sched.stream(job)))) == 9 and job.finish_reason == "length"


def test_submit_errors_and_context_clamp(model_dir: Path):
    engine = _engine(model_dir)
    sched = engine.scheduler
    with pytest.raises(ContextLengthError, match="300 tokens.*context holds 256"):
        sched.submit(_prompt(300, seed=0), GREEDY)
    with pytest.raises(ContextLengthError, match="empty"):
        sched.submit([], GREEDY)
    with pytest.raises(ValueError, match=r"token ids \[999\] are outside the vocabulary"):
        sched.submit([5, 999], GREEDY)
    # prompt + max_new_tokens over the context: generation stops at the context's end
    job = sched.submit(_prompt(250, seed=0), {**GREEDY, "max_new_tokens": 50})
    assert len(_ids(list(sched.stream(job)))) == 6 and job.finish_reason == "length"
    job = sched.submit(_prompt(256, seed=0), GREEDY)
    events = list(sched.stream(job))
    assert [e.finish_reason for e in events] == ["length"] and not events[0].token_ids
    queued = engine.new_scheduler(max_batch=2, max_tokens_per_step=8, max_waiting=1)
    queued.submit(PROMPTS[0], GREEDY)
    with pytest.raises(QueueFullError, match="1 jobs are waiting"):
        queued.submit(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        engine.new_scheduler(max_batch=8, max_tokens_per_step=4)
    assert engine.cache.free_pages == engine.cache.num_pages
    engine.unload()
    with pytest.raises(SchedulerError, match="closed"):
        sched.submit(PROMPTS[0], GREEDY)


def test_max_batch_is_enforced(model_dir: Path):
    engine = _engine(model_dir, max_batch=2)
    sched = engine.scheduler
    settings = {**GREEDY, "max_new_tokens": 4}
    ref = [_single(engine, p, settings)[0] for p in PROMPTS[:5]]
    jobs = [sched.submit(p, settings) for p in PROMPTS[:5]]
    events = []
    while not all(j.done for j in jobs):
        events += sched.step()
        assert sched.num_running <= 2
    by_job = _collect(events)
    assert [_ids(by_job[j.id]) for j in jobs] == ref


def test_logprobs_match_log_softmax(model_dir: Path):
    engine = _engine(model_dir)
    prompt = PROMPTS[3]
    for extra in ({"temperature": 0}, {"temperature": 1.5, "seed": 3}):
        job = engine.scheduler.submit(prompt, {**extra, "max_new_tokens": 6, "logprobs": 3})
        events = list(engine.scheduler.stream(job))
        ids = _ids(events)
        logits = engine.logits(prompt + ids[:-1])[len(prompt) - 1 :]
        expected = torch.log_softmax(logits, dim=-1)
        for i, event in enumerate(events):
            (lp,) = event.logprobs
            assert lp.token_id == ids[i] and len(lp.top) == 3
            assert lp.logprob == pytest.approx(expected[i, ids[i]].item(), abs=1e-4)
            top_values = [v for _, v in lp.top]
            assert top_values == sorted(top_values, reverse=True)
            assert sum(torch.tensor(top_values).exp()) <= 1 + 1e-6
            assert [t for t, _ in lp.top] == expected[i].topk(3).indices.tolist()
            if extra["temperature"] == 0:
                assert lp.top[0][0] == lp.token_id
    job = engine.scheduler.submit(prompt, {"max_new_tokens": 2})
    assert all(e.logprobs is None for e in engine.scheduler.stream(job))


def test_failed_forward_ends_its_jobs_and_scheduler_recovers(model_dir: Path, monkeypatch):
    engine = _engine(model_dir)
    sched = engine.scheduler
    free = engine.cache.free_pages
    jobs = [sched.submit(p, {**GREEDY, "max_new_tokens": 4}) for p in PROMPTS[:2]]

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        list(sched.stream(jobs[0]))
    assert [j.finish_reason for j in jobs] == ["error", "error"]
    assert engine.cache.free_pages == free
    with pytest.raises(RuntimeError, match="device lost"):
        list(sched.stream(jobs[1]))
    monkeypatch.undo()
    job = sched.submit(PROMPTS[0], {**GREEDY, "max_new_tokens": 3})
    assert len(_ids(list(sched.stream(job)))) == 3


def test_loader_stream_many_and_threads(model_dir: Path):
    m = loader.load(model_dir, "kestrel", device="cpu", dtype="float32", page_size=8)
    settings = {**GREEDY, "max_new_tokens": 6}
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[6]]
    ref = [[t for c in m.stream(p, settings) for t in c.token_ids] for p in prompts]
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in m.stream_many(prompts, settings):
        got[chunk.job_id] += chunk.token_ids
    assert [got[i] for i in range(3)] == ref
    # concurrent stream() calls from threads share the scheduler's steps
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = [t for c in m.stream(prompts[i], settings) for t in c.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(3)] == ref


def test_streaming_steps_run_on_one_thread(model_dir: Path, monkeypatch):
    """Streams consumed from several threads (as the API server does, a thread per request)
    have every forward run on the scheduler's one step thread: on a GPU each thread that
    runs a matmul keeps its own cuBLAS workspace for the life of the process. A consumer
    that already holds the engine lock steps inline instead of deadlocking."""
    engine = _engine(model_dir)
    sched = engine.scheduler
    threads_seen: set[str] = set()
    execute = engine.runner.execute

    def recording(*args, **kwargs):
        threads_seen.add(threading.current_thread().name)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", recording)
    settings = {**GREEDY, "max_new_tokens": 5}
    want = [_single(engine, p, settings)[0] for p in PROMPTS[:4]]
    threads_seen.clear()
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = _ids(list(sched.stream(sched.submit(PROMPTS[i], settings))))

    workers = [threading.Thread(target=run, args=(i,), name=f"consumer-{i}") for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert [results.get(i) for i in range(4)] == want
    assert len(threads_seen) == 1 and threads_seen.pop().startswith("kestrel-step")
    with engine.lock:  # re-entrant caller: inline, on this thread
        assert _ids(list(sched.stream(sched.submit(PROMPTS[0], settings)))) == want[0]
    assert threads_seen == {threading.current_thread().name}
    sched.close()
    assert sched._stepper is None


def test_logits_jobs_run_in_the_steps_of_generation(model_dir: Path):
    """Engine.logits is a logits job of the scheduler: it shares steps with generation
    (chunked by the step's budget: these prompts take 3 and 4 chunks), gets every
    position's logits of the whole prompt, changes no generated token and holds no page
    once done."""
    engine = _engine(model_dir)
    settings = {**GREEDY, "max_new_tokens": 6}
    want_tokens = [_single(engine, p, settings)[0] for p in PROMPTS[:3]]
    texts = [PROMPTS[4], PROMPTS[7]]
    want_logits = []
    for ids in texts:  # one forward over the whole prompt, outside the scheduler
        seq = Sequence()
        want_logits.append(engine.runner.forward([seq], [ids], all_logits=True))
        seq.release(engine.cache)
    execute = engine.runner.execute
    mixed = []

    def spy(plan):
        if plan.device_tokens is None:  # not a lookahead's decode step
            mixed.append({row.job.kind for row in plan.rows} == {"generate", "logits"})
        return execute(plan)

    engine.runner.execute = spy
    sched = engine.scheduler
    jobs = [sched.submit(p, settings) for p in PROMPTS[:3]]
    events = sched.step()  # generation is under way when the logits jobs come
    logits_jobs = [sched.submit_logits(ids) for ids in texts]
    events += list(sched.stream_many(jobs + logits_jobs))
    by_job = _collect(events)
    assert [_ids(by_job[job.id]) for job in jobs] == want_tokens
    assert any(mixed)
    for job, want in zip(logits_jobs, want_logits, strict=True):
        assert job.finish_reason == "length"
        torch.testing.assert_close(torch.cat(job.outputs), want, rtol=1e-4, atol=1e-4)
    assert engine.cache.free_pages == engine.cache.num_pages
    torch.testing.assert_close(engine.logits(texts[0]), want_logits[0], rtol=1e-4, atol=1e-4)
    assert engine.cache.free_pages == engine.cache.num_pages


def test_a_session_is_a_job_that_shares_steps_and_gives_up_idle_pages(model_dir: Path):
    """A session (the single-job loop's) is a kind of job: its pieces run in the steps of
    generation, and between pieces its pages are in the scheduler's books, so a job that
    needs them gets them (the session computes its tokens again with its next piece)
    instead of the scheduler stalling on pages held outside it. Its logits stay those of
    one whole forward over its tokens."""
    engine = _engine(model_dir, cache_tokens=64)  # 8 pages of 8
    settings = {**GREEDY, "max_new_tokens": 4}
    text = PROMPTS[5]  # 41 tokens: 6 pages
    want = engine.logits(text + [7, 9])
    execute = engine.runner.execute
    kinds: list[set[str]] = []

    def spy(plan):
        if plan.device_tokens is None:  # not a lookahead's decode step
            kinds.append({row.job.kind for row in plan.rows})
        return execute(plan)

    engine.runner.execute = spy
    sched = engine.scheduler
    session = engine.open_session()
    try:
        job = sched.submit(PROMPTS[0], settings)
        sched.step()  # generation is under way when the session's piece comes
        got = session.prefill(text)
        assert {"session", "generate"} in kinds
        torch.testing.assert_close(got, want[len(text) - 1], rtol=1e-4, atol=1e-4)
        list(sched.stream(job))
        assert engine.cache.free_pages == 2  # the idle session holds 6 pages
        # This job needs 5 pages: the idle session's are freed for it.
        other = sched.submit(PROMPTS[4], settings)
        assert [e.finish_reason for e in sched.stream(other)][-1] == "length"
        assert session.job.preemptions == 1
        torch.testing.assert_close(session.step(7), want[-2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(session.step(9), want[-1], rtol=1e-4, atol=1e-4)
    finally:
        session.close()
    assert engine.cache.free_pages == engine.cache.num_pages
    with pytest.raises(SchedulerError, match="not an open session"):
        session.step(3)


def test_embeddings_take_turns_with_generation(model_dir: Path):
    """Hidden jobs (embeddings) get steps of their own, which alternate with generation's
    while both have work: decoding goes on during a long batch of embeddings, its tokens
    unchanged, and the states are those of each input alone."""
    engine = _engine(model_dir)
    settings = {**GREEDY, "max_new_tokens": 8}
    want_tokens = [_single(engine, p, settings)[0] for p in PROMPTS[:2]]
    inputs = [PROMPTS[n] for n in (2, 5, 7, 3, 6)]
    want_states = [engine.hidden_states_many([ids])[0] for ids in inputs]
    execute = engine.runner.execute
    kinds: list[str] = []

    def spy(plan):
        if plan.device_tokens is None:
            step = {row.job.kind for row in plan.rows}
            assert len(step) == 1 or "hidden" not in step  # never mixed with others
            kinds.append("hidden" if plan.hidden_states else "model")
        else:
            kinds.append("model")
        return execute(plan)

    engine.runner.execute = spy
    sched = engine.scheduler
    jobs = [sched.submit(p, settings) for p in PROMPTS[:2]]
    events = sched.step()
    states = sched.hidden_states(inputs)  # steps generation too, in turns
    events += list(sched.stream_many(jobs))
    by_job = _collect(events)
    assert [_ids(by_job[job.id]) for job in jobs] == want_tokens
    for got, want in zip(states, want_states, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    first, last = kinds.index("hidden"), len(kinds) - 1 - kinds[::-1].index("hidden")
    assert "model" in kinds[first:last]  # decoding went on between embeddings' steps
    assert engine.cache.free_pages == engine.cache.num_pages


def test_unload_frees_the_model_even_while_its_parts_are_held(model_dir: Path):
    """A server may still hold the scheduler or the runner (a stream, a stats call) when
    the model is unloaded: the weights and the K/V storage must go anyway."""
    engine = _engine(model_dir)
    job = engine.scheduler.submit(PROMPTS[1], {**GREEDY, "max_new_tokens": 3})
    engine.scheduler.step()
    model, cache = weakref.ref(engine.model), weakref.ref(engine.cache)
    held = (engine.scheduler, engine.runner, job)
    engine.unload()
    gc.collect()
    assert model() is None and cache() is None
    assert job.finish_reason == "cancelled" and held[0].num_running == 0
