"""Banned strings with rewind (engine/banned_strings.py and the scheduler's rewind) on a
tiny random Llama, on the CPU: a banned string never reaches the stream, other jobs in
the batch are untouched, and seeded output repeats."""

from __future__ import annotations

import random

import pytest

from engine.banned_strings import BannedStrings
from engine.engine import Engine, EngineOptions
from engine.generate import generate_single
from helpers.model_factory import make_tiny_llama

GREEDY = {"temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = tmp_path_factory.mktemp("tiny-llama-banned")
    make_tiny_llama(path)
    options = EngineOptions(
        device="cpu", dtype="float32", max_seq_len=256, page_size=8, cache_tokens=1024
    )
    return Engine.load(path, options)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def _stream(engine: Engine, prompts: list[list[int]], settings: list[dict]):
    jobs = [engine.scheduler.submit(p, s) for p, s in zip(prompts, settings, strict=True)]
    texts = {job.id: [] for job in jobs}
    ids = {job.id: [] for job in jobs}
    for event in engine.scheduler.stream_many(jobs):
        texts[event.job_id].append(event.text)
        ids[event.job_id] += event.token_ids
    return jobs, [texts[j.id] for j in jobs], [ids[j.id] for j in jobs]


def _clean_substring(text: str, at: int, size: int) -> str:
    """A run of `size` letters or digits of `text`, the first from `at` on (else any)."""
    for start in [*range(at, len(text) - size + 1), *range(at)]:
        piece = text[start : start + size]
        if piece.isalnum() and piece.isascii():
            return piece
    raise AssertionError(f"no clean substring in {text!r}")


def test_filter_holds_releases_and_names_the_token():
    banned = BannedStrings(["Kestrel", "foo"])
    assert banned.feed(0, "a ") == ("a ", None)
    assert banned.feed(1, "kes") == ("", None)  # may become "kestrel": held
    assert banned.held_from == 1
    assert banned.feed(2, "t") == ("", None)
    assert banned.feed(3, "REL!") == ("", 1)  # case-insensitive; began in token 1
    assert banned.held_from is None
    assert banned.feed(1, "kelp") == ("kelp", None)  # after the rewind, other text passes
    assert banned.feed(2, "x f") == ("", None)
    assert banned.flush() == "x f"  # generation ended: no banned string was completed


def test_filter_releases_whole_tokens_only():
    banned = BannedStrings(["foo"])
    # "x f" may start "foo": the token is held whole, not split at the space
    assert banned.feed(0, "x f") == ("", None)
    assert banned.feed(1, "ab") == ("x fab", None)
    assert banned.feed(2, "fo") == ("", None)
    assert banned.feed(3, "od") == ("", 2)
    assert banned.flush() == ""


def test_banned_string_never_streamed_and_batch_unaffected(engine: Engine):
    settings = {**GREEDY, "max_new_tokens": 16}
    prompts = [_prompt(7, seed=1), _prompt(12, seed=2), _prompt(4, seed=3)]
    _, ref_texts, ref_ids = _stream(engine, prompts, [settings] * 3)
    full = "".join(ref_texts[0])
    word = _clean_substring(full, len(full) // 3, 2)
    banned = {**settings, "banned_strings": [word.upper(), "never generated"]}
    jobs, texts, ids = _stream(engine, prompts, [banned, settings, settings])
    text = "".join(texts[0])
    assert word.lower() not in text.lower() and text != full
    # the text before the banned string's first occurrence is unchanged
    assert text.startswith(full[: full.lower().find(word.lower())])
    assert engine.tokenizer.decode(ids[0]) == text and ids[0] == jobs[0].generated_ids
    assert len(ids[0]) == 16 and jobs[0].output.rewinds > 0
    # the other jobs of the batch are untouched
    assert ids[1:] == ref_ids[1:]
    assert engine.scheduler.stats()["rewinds"] > 0
    assert engine.cache.free_pages == engine.cache.num_pages
    # the single-job loop (which recomputes instead of trimming) agrees
    single = list(generate_single(engine, prompts[0], banned))
    assert [t for e in single for t in e.token_ids] == ids[0]


def test_seeded_banned_strings_repeat(engine: Engine):
    settings = {"max_new_tokens": 20, "temperature": 1.0, "seed": 3}
    prompt = _prompt(6, seed=9)
    _, texts, _ = _stream(engine, [prompt], [settings])
    full = "".join(texts[0])
    words = [_clean_substring(full, 0, 1), _clean_substring(full, len(full) // 2, 1)]
    banned = {**settings, "banned_strings": words}
    runs = [_stream(engine, [prompt], [banned]) for _ in range(2)]
    (_, texts_a, ids_a), (_, texts_b, ids_b) = runs
    assert ids_a == ids_b and texts_a == texts_b
    text = "".join(texts_a[0])
    assert all(w.lower() not in text.lower() for w in words)
