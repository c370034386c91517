"""The scheduler's lookahead (engine/scheduler.py, "Lookahead"): the next decode forward is
launched from tokens still on the device, before the last step's tokens are read. It must
change nothing a client sees: the same tokens, text, finish reasons and events as without
it, with stops, banned-string rewinds, admissions and cancellations in the mix; and every
cache page comes back. On the CPU the forward runs eagerly from the read-back tokens, so
the bookkeeping is checked here; on a GPU the decode graph takes the tokens on the device.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.engine import Engine, EngineOptions
from engine.generate import generate_single
from engine.generator import GenerationEvent
from helpers.model_factory import make_tiny_llama

GREEDY = {"temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-lookahead")
    make_tiny_llama(path)
    return path


def _engine(path: Path, lookahead: bool, device: str = "cpu", **options) -> Engine:
    base = dict(
        device=device,
        dtype="float32" if device == "cpu" else "float16",
        max_seq_len=256,
        page_size=8,
        cache_tokens=1024,
        prefill_chunk=32,
        max_batch=3,
        lookahead=lookahead,
    )
    return Engine.load(path, EngineOptions(**{**base, **options}))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def _run(engine: Engine, jobs_spec: list[tuple[list[int], dict]]) -> list[list[tuple]]:
    """Every job's events as (text, token ids, finish reason), submitted at once and
    streamed together (max_batch 3: later jobs are admitted as earlier ones end)."""
    sched = engine.scheduler
    jobs = [sched.submit(p, s) for p, s in jobs_spec]
    events: dict[int, list[GenerationEvent]] = {job.id: [] for job in jobs}
    for event in sched.stream_many(jobs):
        events[event.job_id].append(event)
    return [[(e.text, e.token_ids, e.finish_reason) for e in events[j.id]] for j in jobs]


def _ids(events: list[tuple]) -> list[int]:
    return [t for _, ids, _ in events for t in ids]


def test_same_events_with_and_without_lookahead(model_dir: Path) -> None:
    plain = _engine(model_dir, lookahead=False)
    ahead = _engine(model_dir, lookahead=True)
    prompts = [_prompt(n, seed=n) for n in (5, 12, 40, 9, 23, 17)]
    # A stop string from the middle of what job 0 generates greedily, a stop token id,
    # and a banned string: jobs that end or rewind where a lookahead forward already ran.
    ids, text = [], ""
    for event in generate_single(plain, prompts[0], {**GREEDY, "max_new_tokens": 24}):
        ids += event.token_ids
        text += event.text
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i : i + 2].isalnum())  # fmt: skip
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    settings = [
        {**GREEDY, "max_new_tokens": 24, "stop": [stop]},
        {"max_new_tokens": 20, "temperature": 0.9, "top_k": 40, "seed": 5},
        {**GREEDY, "max_new_tokens": 30, "repetition_penalty": 1.3},
        {**GREEDY, "max_new_tokens": 24, "stop_token_ids": [ids[k]]},
        {**GREEDY, "max_new_tokens": 24, "banned_strings": [stop]},
        {"max_new_tokens": 12, "temperature": 1.2, "min_p": 0.05, "seed": 9},
    ]
    spec = list(zip([*prompts[:3], prompts[0], prompts[0], prompts[5]], settings, strict=True))
    free = ahead.cache.free_pages
    expected = _run(plain, spec)
    got = _run(ahead, spec)
    assert got == expected
    assert expected[0][-1][2] == "stop" and expected[3][-1][2] == "stop"
    assert _ids(expected[3])[-1] == ids[k]
    stats = ahead.scheduler.stats()
    assert stats["rewinds"] > 0  # job 4 met its banned string and went back
    assert stats["lookahead_forwards"] > 10 and plain.scheduler.stats()["lookahead_forwards"] == 0
    # the stopped jobs' looked-ahead rows were dropped; every page is back
    assert stats["lookahead_dropped_rows"] >= 2
    assert ahead.cache.free_pages == free


def test_steady_decode_runs_ahead_every_step(model_dir: Path) -> None:
    # No stops, no admissions after the first steps: after the prompts, every step's
    # forward is launched ahead and no row is ever dropped (a row dropped for nothing
    # means the in-flight cache slot was lost, e.g. trimmed when its token was read).
    engine = _engine(model_dir, lookahead=True)
    spec = [(_prompt(6 + i, seed=i), {**GREEDY, "max_new_tokens": 12}) for i in range(3)]
    events = _run(engine, spec)
    assert all(len(_ids(e)) == 12 for e in events)
    stats = engine.scheduler.stats()
    assert stats["lookahead_dropped_rows"] == 0
    # 11 decode forwards per job after the one that ends its prompt, the last token's
    # forward is never launched: at least 10 of them ran ahead.
    assert stats["lookahead_forwards"] >= 10


def test_device_tokens_go_through_the_decode_graph_rows(model_dir: Path) -> None:
    # The runner's lookahead path as a GPU takes it, on the decode graphs' static buffers
    # (capture=False runs them eagerly on the CPU): the drawn tokens are copied into the
    # graph's token column, never read back first; the events equal those without
    # lookahead or graphs.
    plain = _engine(model_dir, lookahead=False)
    ahead = _engine(model_dir, lookahead=True)
    graphs = ahead.enable_decode_graphs(capture=False)
    spec = [(_prompt(5 + 4 * i, seed=i), {**GREEDY, "max_new_tokens": 16}) for i in range(3)]
    device_steps = []
    original = graphs.decode

    def spy(sequences, tokens, **options):
        device_steps.append(isinstance(tokens, torch.Tensor))
        return original(sequences, tokens, **options)

    graphs.decode = spy
    assert _run(ahead, spec) == _run(plain, spec)
    assert sum(device_steps) >= 10
    assert ahead.scheduler.stats()["lookahead_forwards"] == sum(device_steps)
    assert ahead.cache.free_pages == ahead.cache.num_pages


def test_a_waiting_job_is_admitted_without_delay(model_dir: Path) -> None:
    # Lookahead stops for a job that waits with room in the batch: the step that reads
    # the drawn tokens runs a normal step, which admits it.
    engine = _engine(model_dir, lookahead=True)
    sched = engine.scheduler
    first = sched.submit(_prompt(5, seed=1), {**GREEDY, "max_new_tokens": 40})
    for _ in range(4):
        sched.step()
    assert sched._drawn is not None  # noqa: SLF001 - a lookahead is in flight
    late = sched.submit(_prompt(7, seed=2), {**GREEDY, "max_new_tokens": 4})
    sched.step()
    assert late.state != "waiting" and late.prefill_tokens == 7
    sched.cancel(first)
    sched.cancel(late)
    assert engine.cache.free_pages == engine.cache.num_pages


def test_a_lookahead_out_of_memory_is_undone_and_no_job_ends(model_dir: Path) -> None:
    # A lookahead forward may allocate (a graph captured for a new batch size, an eager
    # step). Out of memory there trims the sequences back and a normal step follows.
    plain = _engine(model_dir, lookahead=False)
    ahead = _engine(model_dir, lookahead=True)
    spec = [(_prompt(6 + i, seed=i), {**GREEDY, "max_new_tokens": 10}) for i in range(3)]
    execute = ahead.runner.execute
    calls = []

    def fail_once(plan):
        if plan.device_tokens is not None:  # a lookahead forward
            calls.append(len(plan))
            if len(calls) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return execute(plan)

    ahead.runner.execute = fail_once
    assert _run(ahead, spec) == _run(plain, spec)
    stats = ahead.scheduler.stats()
    assert stats["lookahead_out_of_memory"] == 1 and len(calls) > 3
    assert ahead.cache.free_pages == ahead.cache.num_pages


def test_events_read_before_a_failing_step_are_kept(model_dir: Path) -> None:
    # step() reads the drawn tokens, then (a job waits: no lookahead) runs a normal step.
    # If that one fails, the tokens already read are queued on their jobs, not lost.
    engine = _engine(model_dir, lookahead=True)
    sched = engine.scheduler
    job = sched.submit(_prompt(5, seed=1), {**GREEDY, "max_new_tokens": 20})
    seen = [t for _ in range(3) for e in sched.step() for t in e.token_ids]
    sched.submit(_prompt(6, seed=2), {**GREEDY, "max_new_tokens": 2})
    model = engine.model
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broken forward"))
    try:
        with pytest.raises(RuntimeError, match="broken forward"):
            sched.step()
    finally:
        del model.forward
    queued = [t for e in job.events for t in e.token_ids]
    assert queued and seen + queued == job.generated_ids[: len(seen) + len(queued)]


@pytest.mark.gpu
def test_gpu_graph_takes_device_tokens_without_a_host_sync(tmp_path: Path) -> None:
    # On a GPU the looked-ahead forward is a decode graph replay whose token column is
    # copied on the device: the tokens equal those without lookahead, the graph path ran,
    # and a steady-state step makes no implicit host sync (only the pinned read-back's
    # event wait, which sync debug mode does not count).
    make_tiny_llama(tmp_path, dtype=torch.float16)
    plain = _engine(tmp_path, lookahead=False, device="cuda")
    ahead = _engine(tmp_path, lookahead=True, device="cuda")
    spec = [(_prompt(5 + 3 * i, seed=i), {**GREEDY, "max_new_tokens": 24}) for i in range(3)]
    assert _run(ahead, spec) == _run(plain, spec)
    calls = []
    graphs = ahead.graphs
    assert graphs is not None
    original = graphs.decode

    def spy(sequences, tokens, **options):
        if isinstance(tokens, torch.Tensor):  # device tokens: the lookahead's path
            calls.append(1)
        return original(sequences, tokens, **options)

    graphs.decode = spy
    sched = ahead.scheduler
    jobs = [sched.submit(p, {**GREEDY, "max_new_tokens": 40}) for p, _ in spec]
    for _ in range(6):
        sched.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            sched.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) >= 15
    for job in jobs:
        sched.cancel(job)


def test_lookahead_is_a_load_option(model_dir: Path) -> None:
    # The kestrel loader's settings schema offers the switch (the UI and TGW render it),
    # and loading with it off gives a scheduler that never runs ahead.
    import loader

    schema = loader.settings_schema("kestrel")
    control = next(c for c in schema.controls if c.name == "lookahead")
    assert control.kind == "bool" and control.default is True
    model = loader.load(model_dir, "kestrel", device="cpu", lookahead=False)
    try:
        sched = model.engine.scheduler
        assert sched.lookahead is False
        job = sched.submit(_prompt(5, seed=3), {**GREEDY, "max_new_tokens": 6})
        assert len(_ids([(e.text, e.token_ids, e.finish_reason) for e in sched.stream(job)])) == 6
        assert sched.stats()["lookahead_forwards"] == 0
    finally:
        model.unload()
