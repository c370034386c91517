"""What the Chat and Notebook tabs run (webui.generation), on a tiny random model: streaming
with token counts, the stop switch, continuing a reply, and fitting a long chat or prompt
into the truncation length."""

from __future__ import annotations

import threading

import pytest

from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from serving import shared
from webui import generation, sampler_controls

MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    make_tiny_llama(models / "tiny", max_position_embeddings=1024)
    previous = shared.manager
    shared.manager = ModelManager(models)
    shared.manager.load("tiny", device="cpu", max_seq_len=1024)
    yield shared.manager
    shared.manager.unload()
    shared.manager = previous


def state(**changes):
    return {**sampler_controls.defaults(), "ban_eos_token": True, "seed": 1, **changes}


def test_chat_reply_streams_cumulative_text_with_counts(manager):
    steps = list(generation.chat_reply(MESSAGES, state(max_new_tokens=12), threading.Event()))
    last = steps[-1]
    assert last.done and last.error is None and last.finish_reason == "length"
    assert last.completion_tokens == 12 and "12 tokens" in last.status and "tok/s" in last.status
    texts = [s.text for s in steps]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    # Same seed, same settings: the UI's parameters reach the sampler.
    again = list(generation.chat_reply(MESSAGES, state(max_new_tokens=12), threading.Event()))
    assert again[-1].text == last.text


def test_stop_switch_ends_the_reply(manager):
    stop = threading.Event()
    steps = []
    for progress in generation.chat_reply(MESSAGES, state(max_new_tokens=600), stop):
        steps.append(progress)
        stop.set()
    assert steps[-1].finish_reason == "cancelled" and "stopped" in steps[-1].status
    assert steps[-1].completion_tokens < 600


def test_continue_appends_to_the_last_reply(manager):
    first = list(generation.chat_reply(MESSAGES, state(max_new_tokens=8), threading.Event()))
    history = [*MESSAGES, {"role": "assistant", "content": first[-1].text}]
    more = list(generation.continue_reply(history, state(max_new_tokens=8), threading.Event()))
    assert more[-1].text.startswith(first[-1].text) and len(more[-1].text) > len(first[-1].text)
    assert more[-1].completion_tokens == 8


def test_long_chat_and_prompt_fit_the_truncation_length(manager):
    model = manager.current()
    turns = []
    for i in range(30):
        turns += [
            {"role": "user", "content": f"The quick brown fox number {i} jumps."},
            {"role": "assistant", "content": "Kestrels hover over fields."},
        ]
    history = [{"role": "system", "content": "Be kind."}, *turns, MESSAGES[0]]
    limit, new = generation.budget(model, state(truncation_length=256, max_new_tokens=64))
    assert (limit, new) == (192, 64)
    fitted = generation.fit_messages(model, history, limit)
    assert fitted[0] == history[0] and fitted[-1] == history[-1] and len(fitted) < len(history)
    prompt = model.apply_chat_template(fitted, add_generation_prompt=True)
    assert len(model.encode(prompt, add_bos=False)) <= limit
    small = state(truncation_length=256, max_new_tokens=4)
    steps = list(generation.chat_reply(history, small, threading.Event()))
    assert steps[-1].error is None and 0 < steps[-1].prompt_tokens <= 256 - 4
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 200
    done = list(
        generation.complete(
            long_prompt, state(truncation_length=300, max_new_tokens=4), threading.Event()
        )
    )
    assert done[-1].error is None and done[-1].completion_tokens == 4


def test_bad_settings_and_no_model_are_reported_not_raised(manager):
    bad = list(generation.chat_reply(MESSAGES, state(top_p=0), threading.Event()))
    assert bad[-1].error and "top_p" in bad[-1].error
    saved = shared.manager
    shared.manager = ModelManager(saved.models_dir)
    try:
        none = list(generation.complete("Hi", state(), threading.Event()))
    finally:
        shared.manager = saved
    assert none[-1].error and "Load a model first" in none[-1].error
