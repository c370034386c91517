"""Bad values from the web UI's fields reach its generation and load paths (webui.generation,
webui.load_options + the model manager, as the Chat/Notebook/Model tabs call them, without a
browser) and come back as a message naming the field, never as an exception into Gradio;
the UI then still generates."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from serving import shared
from webui import generation, load_options, sampler_controls

NAN, INF = float("nan"), float("inf")
CHAT = [{"role": "user", "content": "Once upon a time"}]
CONTINUE = [*CHAT, {"role": "assistant", "content": "there was"}]


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelManager]:
    models = tmp_path_factory.mktemp("ui-models")
    make_tiny_llama(models / "tiny", max_position_embeddings=512)
    (models.parent / "outside").mkdir(exist_ok=True)
    previous = shared.manager
    shared.manager = ModelManager(models)
    shared.manager.load("tiny", device="cpu", max_seq_len=512, cache_tokens=1024)
    yield shared.manager
    shared.manager.unload()
    shared.manager = previous


def _state(**changes) -> dict:
    return {**sampler_controls.defaults(), "ban_eos_token": True, "seed": 1,
            "max_new_tokens": 3, **changes}  # fmt: skip


def _run(kind: str, state: dict) -> list[generation.Progress]:
    stop = threading.Event()
    if kind == "chat":
        return list(generation.chat_reply(CHAT, state, stop))
    if kind == "continue":
        return list(generation.continue_reply(CONTINUE, state, stop))
    return list(generation.complete("Once upon a time", state, stop))


BAD_FIELDS = [
    ("temperature", NAN), ("temperature", INF), ("temperature", -1), ("temperature", "hot"),
    ("temperature", None), ("temperature", 1e300), ("top_p", 0), ("top_p", NAN),
    ("top_k", 1e20), ("top_k", -3), ("min_p", 2), ("seed", 1.5), ("seed", "x"),
    ("max_new_tokens", -5), ("max_new_tokens", 0), ("max_new_tokens", NAN),
    ("max_new_tokens", INF), ("max_new_tokens", "many"), ("truncation_length", -100),
    ("truncation_length", NAN), ("truncation_length", "x"), ("min_new_tokens", 1e20),
    ("repetition_penalty", 0), ("presence_penalty", -1e9), ("mirostat_tau", 1e39),
    ("logit_bias", "{oops"), ("logit_bias", '{"5": 1e39}'), ("logit_bias", '{"5": NaN}'),
    ("logit_bias", "[1]"), ("custom_stopping_strings", '"unterminated'),
    ("custom_stopping_strings", "5"), ("banned_strings", "x" * 5000),
    ("dry_sequence_breakers", "["), ("custom_token_bans", "a, b"), ("sampler_priority", 5),
]  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "continue", "notebook"])
@pytest.mark.parametrize(("key", "value"), BAD_FIELDS, ids=repr)
def test_bad_field_is_a_message_naming_it(manager, kind: str, key: str, value) -> None:
    steps = _run(kind, _state(**{key: value}))
    last = steps[-1]
    assert last.done and last.error, last
    assert key in last.error and last.status.startswith("error:"), last.error
    assert manager.current().backend.scheduler.stats()["running"] == 0


def test_bad_text_in_a_chat_message_is_shown(manager) -> None:
    for content in ("a\ud800b", "x" * 200_000):
        messages = [{"role": "user", "content": content}]
        last = list(generation.chat_reply(messages, _state(), threading.Event()))[-1]
        # a last message alone over the context cannot be cut to fit: it says so
        expected = "surrogate" if content.startswith("a") else "the context holds 512"
        assert last.done and last.error and expected in last.error, last.error


BAD_LOAD_FIELDS = [
    ({"max_seq_len": NAN}, "max_seq_len"), ({"max_seq_len": INF}, "max_seq_len"),
    ({"max_seq_len": "long"}, "max_seq_len"), ({"max_seq_len": -5}, "max_seq_len"),
    ({"max_seq_len": 1.5}, "max_seq_len"), ({"rope_alpha": "abc"}, "rope_alpha"),
    ({"rope_alpha": NAN}, "rope_alpha"), ({"gpu_split": "a,b"}, "gpu_split"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "key"), BAD_LOAD_FIELDS, ids=repr)
def test_bad_load_fields_name_the_key(values: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        load_options.load_kwargs(values)


@pytest.mark.parametrize(
    ("name", "options", "text"),
    [
        ("../outside", {}, "not a path"),
        ("/etc", {}, "absolute path"),
        ("..", {}, "invalid model name"),
        ("nope", {}, "no model named 'nope'"),
        ("tiny", {"cache_type": "evil"}, "cache_type"),
        ("tiny", {"max_seq_len": 10**9}, "max_seq_len"),
        ("tiny", {"max_seq_len": -1}, "max_seq_len"),
        ("tiny", {"rope_alpha": 1e9}, "rope_alpha"),
        ("tiny", {"max_batch": 0}, "max_batch"),
    ],
)
def test_bad_model_loads_are_refused_and_the_model_stays(
    manager: ModelManager, name: str, options: dict, text: str
) -> None:
    with pytest.raises(Exception, match=text):  # the Model tab shows str(error)
        manager.load(name, "kestrel", **options)
    assert manager.is_loaded() and manager.name == "tiny"


def test_unknown_load_option_is_named(manager: ModelManager) -> None:
    # Options outside the schema reach the loader: the old model is gone by then (a failed
    # load never leaves a half-loaded one), and the UI can load again.
    with pytest.raises(Exception, match="warp_drive"):
        manager.load("tiny", "kestrel", warp_drive=True)
    manager.load("tiny", device="cpu", max_seq_len=512, cache_tokens=1024)


def test_ui_still_generates_after_bad_input(manager) -> None:
    last = _run("chat", _state())[-1]
    assert last.error is None and last.completion_tokens == 3
