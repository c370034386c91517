"""Prefix caching: page refcounts, the LRU of cached pages, chain hashes, and reuse by the
scheduler (a repeated prompt prefix is adopted, not recomputed, and changes no token)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.cache import PagedKVCache, Sequence
from engine.engine import Engine, EngineOptions
from engine.generate import generate_single
from engine.prefix_cache import PrefixChain, adopt, find_prefix, publish, root_hash
from engine.scheduler import DECODE
from helpers.model_factory import make_tiny_llama

GREEDY = {"temperature": 0, "ban_eos_token": True}


def _cache(num_pages: int = 4, page_size: int = 4) -> PagedKVCache:
    return PagedKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        num_pages=num_pages,
        page_size=page_size,
        dtype=torch.float32,
        layer_devices=[torch.device("cpu")],
    )


def _filled(cache: PagedKVCache, tokens: list[int]) -> tuple[Sequence, PrefixChain]:
    """A sequence holding `tokens` (as a forward would leave it), its full pages published."""
    seq, chain = Sequence(), PrefixChain(cache.page_size)
    seq.reserve(cache, len(tokens))
    seq.length = len(tokens)
    publish(cache, seq, chain, tokens, 0)
    return seq, chain


def test_refcounts_and_lru():
    cache = _cache()
    seq, chain = _filled(cache, list(range(10)))  # 2 full pages hashed, 1 partial private
    assert cache.cached_pages == 2 and cache.free_pages == 1
    assert [cache.refcount(p) for p in seq.pages] == [1, 1, 1]
    assert [cache.is_shared(p) for p in seq.pages] == [True, True, False]
    other = Sequence()
    pages = find_prefix(cache, PrefixChain(4), list(range(12)), max_pages=3)
    assert pages == seq.pages[:2]
    assert adopt(cache, other, pages) == 8 and [cache.refcount(p) for p in pages] == [2, 2]
    seq.release(cache)  # the private page is free again, the shared ones still held
    assert cache.free_pages == 2 and [cache.refcount(p) for p in pages] == [1, 1]
    other.release(cache)  # hashed pages at count 0 are kept, and count as free
    assert cache.free_pages == 4 and cache.cached_pages == 2
    again = Sequence()
    assert adopt(cache, again, find_prefix(cache, chain, list(range(10)), 2)) == 8
    assert cache.free_pages == 2
    again.release(cache)
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release([pages[0]])
    with pytest.raises(RuntimeError, match="only cached pages can be acquired"):
        cache.acquire([next(p for p in range(4) if p not in pages)])


def test_lru_evicts_the_end_of_a_prefix_first():
    cache = _cache(num_pages=4)
    seq, chain = _filled(cache, list(range(12)))  # 3 full pages
    first, second, third = seq.pages
    seq.release(cache)
    assert cache.allocate(1) != [third]  # a never-used page goes first
    assert cache.allocate(1) == [third]  # then the LRU, deepest page first
    assert cache.cached_pages == 2
    assert find_prefix(cache, PrefixChain(4), list(range(12)), 3) == [first, second]
    cache.allocate(2)
    assert cache.cached_pages == 0 and cache.free_pages == 0


def test_duplicate_prefix_stays_private():
    cache = _cache(num_pages=4)
    a, _ = _filled(cache, list(range(4)))
    b, _ = _filled(cache, list(range(4)))  # computed twice: the first page serves
    assert cache.cached_pages == 1 and not cache.is_shared(b.pages[0])
    b.release(cache)
    a.release(cache)
    assert cache.free_pages == 4 and cache.cached_pages == 1
    cache.clear_prefix_cache()
    assert cache.free_pages == 4 and cache.cached_pages == 0


def test_shared_partial_page_is_never_written():
    cache = _cache()
    seq, _ = _filled(cache, list(range(4)))
    seq.length = 2  # pretend the sequence ends inside its hashed (immutable) page
    with pytest.raises(RuntimeError, match="shared and must not be written"):
        seq.reserve(cache, 3)


def test_chain_hashes():
    tokens = list(range(20))
    a, b = PrefixChain(4), PrefixChain(4)
    assert [a.get(i, tokens) for i in range(5)] == [b.get(i, tokens) for i in range(5)]
    changed = [99, *tokens[1:]]
    c = PrefixChain(4)
    # a change in page 0 changes every later hash: the chain covers the whole prefix
    assert all(c.get(i, changed) != a.hashes[i] for i in range(5))
    lora = PrefixChain(4, root=root_hash("lora:x=1.0"))
    assert lora.get(0, tokens) != a.hashes[0]
    with pytest.raises(ValueError, match="not full"):
        PrefixChain(4).get(1, tokens[:7])


# -- reuse through the scheduler ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path, seed=1)
    return path


def _engine(path: Path, **options) -> Engine:
    base = dict(
        device="cpu",
        dtype="float32",
        max_seq_len=256,
        page_size=8,
        cache_tokens=256,
        prefill_chunk=16,
        max_batch=4,
    )
    return Engine.load(path, EngineOptions(**{**base, **options}))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def _run(engine: Engine, prompt: list[int], settings: dict):
    job = engine.scheduler.submit(prompt, settings)
    events = list(engine.scheduler.stream(job))
    return job, [t for e in events for t in e.token_ids], events[-1]


def _uncached(engine: Engine, prompt: list[int], settings: dict) -> list[int]:
    return [t for e in generate_single(engine, prompt, settings) for t in e.token_ids]


def test_repeated_prefix_is_reused(model_dir: Path):
    engine = _engine(model_dir)
    settings = {**GREEDY, "max_new_tokens": 6}
    base = _prompt(40, seed=0)  # 5 full pages
    first, second = base + [5, 6, 7], base + _prompt(5, seed=9)
    free = engine.cache.free_pages
    job, ids, last = _run(engine, first, settings)
    assert job.cached_tokens == 0 and job.prefill_tokens == 43 and last.cached_tokens == 0
    assert ids == _uncached(engine, first, settings)
    assert engine.cache.free_pages == free and engine.cache.cached_pages == 6  # 48 tokens
    job, ids, last = _run(engine, second, settings)
    assert job.cached_tokens == 40 and job.prefill_tokens == 5 and last.cached_tokens == 40
    assert ids == _uncached(engine, second, settings)
    # the same prompt again, ending on a page boundary: all pages but the last are reused,
    # so one private page is computed and no shared page is written
    aligned = base[:32]
    _run(engine, aligned, settings)
    job, ids, _ = _run(engine, aligned, settings)
    assert job.cached_tokens == 24 and ids == _uncached(engine, aligned, settings)
    assert engine.cache.free_pages == free


def test_running_jobs_share_pages_by_refcount(model_dir: Path):
    engine = _engine(model_dir)
    sched = engine.scheduler
    settings = {**GREEDY, "max_new_tokens": 8}
    base = _prompt(32, seed=1)
    a = sched.submit(base + [11, 12], settings)
    while a.state != DECODE:
        sched.step()
    b = sched.submit(base + [13, 14, 15], settings)
    sched.step()
    shared = a.sequence.pages[:4]
    assert b.sequence.pages[:4] == shared and b.cached_tokens == 32
    assert [engine.cache.refcount(p) for p in shared] == [2, 2, 2, 2]
    assert a.sequence.pages[4] != b.sequence.pages[4]  # the partial pages are private
    for job in (a, b):
        list(sched.stream(job))
    assert a.generated_ids == _uncached(engine, a.prompt_ids, settings)
    assert b.generated_ids == _uncached(engine, b.prompt_ids, settings)
    assert engine.cache.free_pages == engine.cache.num_pages


def test_generated_tokens_are_cached_for_the_next_turn(model_dir: Path):
    engine = _engine(model_dir)
    settings = {**GREEDY, "max_new_tokens": 20}
    job, ids, _ = _run(engine, _prompt(20, seed=2), settings)
    # the cache held 20 + 19 tokens: 4 full pages, 12 of them generated
    follow_up = job.prompt_ids + ids + [7, 8]
    job, ids, _ = _run(engine, follow_up, {**GREEDY, "max_new_tokens": 4})
    assert job.cached_tokens == 32 and ids == _uncached(engine, follow_up, settings)[:4]


def test_cached_pages_are_reclaimed_when_the_cache_runs_dry(model_dir: Path):
    engine = _engine(model_dir, cache_tokens=64)  # 8 pages
    settings = {**GREEDY, "max_new_tokens": 4}
    first = _prompt(40, seed=3)
    _, ids, _ = _run(engine, first, settings)
    assert engine.cache.cached_pages == 5 and engine.cache.free_pages == 8
    big = _prompt(55, seed=4)  # needs all 8 pages: the cached ones are evicted
    _, big_ids, _ = _run(engine, big, {**GREEDY, "max_new_tokens": 9})
    assert big_ids == _uncached(engine, big, {**GREEDY, "max_new_tokens": 9})
    job, again, _ = _run(engine, first, settings)
    assert job.cached_tokens == 0 and again == ids
    plain = _engine(model_dir, prefix_caching=False)
    job, ids_plain, _ = _run(plain, first, settings)
    job, _, _ = _run(plain, first, settings)
    assert job.cached_tokens == 0 and plain.cache.cached_pages == 0 and ids_plain == ids
