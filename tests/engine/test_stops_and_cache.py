"""Stop-string hold-back and paged-cache bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch

from engine.cache import CacheFullError, ForwardBatch, PagedKVCache, Sequence
from engine.stops import StopMatcher


def _feed_all(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_never_leak(seed: int):
    rng = random.Random(seed)
    text = "Hello there.\nUser: what? ### Done\n\nUser:"
    stops = ["User:", "###", "\n\n"]
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out, hit = _feed_all(stops, pieces)
    # exactly the text before the first stop string, however the stream was cut
    assert hit and out == "Hello there.\n"


def test_partial_stop_released_when_not_completed():
    m = StopMatcher(["</end>"])
    assert m.feed("abc</e") == ("abc", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("</en") == ("", False)
    assert m.flush() == "</en"


def test_no_stops_passes_through():
    assert _feed_all([], ["a", "b"]) == ("ab", False)


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


def test_batch_slots_and_page_reuse():
    cache = _cache()
    a, b = Sequence(), Sequence()
    batch = ForwardBatch.build(cache, [a, b], [[1, 2, 3, 4, 5], [6]])
    assert len(a.pages) == 2 and len(b.pages) == 1 and cache.free_pages == 1
    pa, pb = a.pages, b.pages
    expected = [pa[0] * 4 + i for i in range(4)] + [pa[1] * 4, pb[0] * 4]
    assert batch.slots.tolist() == expected
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0]
    assert batch.cu_seqlens.tolist() == [0, 5, 6]
    assert batch.logits_indices.tolist() == [4, 5]
    batch = ForwardBatch.build(cache, [a], [[7]], all_logits=True)
    assert batch.positions.tolist() == [5] and batch.slots.tolist() == [pa[1] * 4 + 1]
    a.release(cache)
    b.release(cache)
    assert cache.free_pages == 4


def test_cache_full_is_a_clear_error():
    cache = _cache(num_pages=2)
    with pytest.raises(CacheFullError, match="needs 3 more pages of 4 tokens, 2 are free"):
        ForwardBatch.build(cache, [Sequence()], [list(range(10))])
