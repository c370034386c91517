"""Bad requests against the real OpenAI-compatible server (uvicorn on loopback, a tiny random
Llama on the kestrel loader): every one gets a 4xx with an OpenAI-style error that names the
field (`param`) and, where there is one, the value; afterwards the server still answers a good
request and no cache page is left in use. Raw bodies go through httpx (NaN, invalid UTF-8,
malformed JSON), typed ones through the `openai` client; hypothesis fuzzes sampler fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from extensions.openai import ApiServer, run_api_server
from extensions.openai.limits import DEFAULT_MAX_BODY_BYTES
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from serving import shared

LOAD_OPTIONS = dict(
    device="cpu", dtype="float32", page_size=16, cache_tokens=512, max_seq_len=256, max_batch=8
)  # fmt: skip
COMPLETION = {"model": "tiny", "prompt": "Once upon", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelManager]:
    root = tmp_path_factory.mktemp("bad-api")
    make_tiny_llama(root / "models" / "tiny")
    (root / "loras").mkdir()
    (root / "secret").mkdir()  # what "../secret" would reach
    manager = ModelManager(root / "models", root / "loras")
    manager.load("tiny", "kestrel", **LOAD_OPTIONS)
    previous, shared.manager = shared.manager, manager
    yield manager
    shared.manager = previous
    manager.unload()


@pytest.fixture(scope="module")
def server(manager: ModelManager) -> Iterator[ApiServer]:
    running = run_api_server("127.0.0.1", 0, manager=manager)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: ApiServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _post(server: ApiServer, path: str, body: Any = None, raw: bytes | None = None, **kw):
    # json.dumps writes NaN/Infinity literals, as a careless client would.
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}/v1{path}", content=content, headers=headers, timeout=60, **kw)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert len(error["message"]) < 1200  # values are echoed, but cut
    return error


def _still_serves(server: ApiServer, manager: ModelManager) -> None:
    good = _post(server, "/completions", COMPLETION)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    stats = manager.current().backend.scheduler.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_pages"] == stats["usable_pages"]


# (body changes, param the error names, text the message holds)
BAD_COMPLETIONS = [
    ({"temperature": NAN}, "temperature", "nan"),
    ({"temperature": INF}, "temperature", "inf"),
    ({"temperature": -1}, "temperature", "-1"),
    ({"temperature": 1e300}, "temperature", "1e+300"),
    ({"temperature": "hot"}, "temperature", "hot"),
    ({"top_p": 0}, "top_p", "0"),
    ({"top_p": -INF}, "top_p", "-inf"),
    ({"top_p": 1.5}, "top_p", "1.5"),
    ({"top_k": 10**20}, "top_k", "100000000000000000000"),
    ({"min_p": NAN}, "min_p", "nan"),
    ({"max_tokens": -1}, "max_tokens", "-1"),
    ({"max_tokens": 1.5}, "max_tokens", "1.5"),
    ({"max_tokens": [3]}, "max_tokens", "[3]"),
    ({"n": 0}, "n", "0"),
    ({"n": 10**9}, "n", "1000000000"),
    ({"n": "many"}, "n", "many"),
    ({"seed": -5}, "seed", "-5"),
    ({"seed": 2**70}, "seed", str(2**70)),
    ({"presence_penalty": -INF}, "presence_penalty", "-inf"),
    ({"frequency_penalty": 1e9}, "frequency_penalty", "1000000000"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "abc"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "-1"),
    ({"logit_bias": {"5": NAN}}, "logit_bias", "nan"),
    ({"logit_bias": {"5": 1e39}}, "logit_bias", "1e+39"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "99999"),
    ({"logit_bias": [1, 2]}, "logit_bias", "[1, 2]"),
    ({"stop": [f"stop{i}" for i in range(1000)]}, "stop", "1000"),
    ({"stop": ["x" * 100_000]}, "stop", "100000"),
    ({"stop": [1, 2]}, "stop", "1"),
    ({"stop": {"a": 1}}, "stop", "a"),
    ({"stop": "\ud800"}, "stop", "surrogate"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": "fox " * 1000}, "prompt", "the context holds 256"),
    ({"prompt": [7] * 300}, "prompt", "300 tokens"),
    ({"prompt": [999999]}, "prompt", "999999"),
    ({"prompt": [-3]}, "prompt", "-3"),
    ({"prompt": 5}, "prompt", "5"),
    ({"prompt": None}, "prompt", "None"),
    ({"prompt": "ab\ud800cd"}, "prompt", "surrogate"),
    ({"prompt": {"text": "hi"}}, "prompt", "text"),
    ({"logprobs": 100}, "logprobs", "100"),
    ({"best_of": 3}, "best_of", "best_of"),
    ({"stream": [1]}, "stream", "[1]"),
    ({"stream_options": {"include_usage": "x"}}, "stream_options.include_usage", "x"),
    ({"sampler_priority": 5}, "sampler_priority", "5"),
    ({"dry_sequence_breakers": 5}, "dry_sequence_breakers", "5"),
    ({"custom_token_bans": "1, x"}, "custom_token_bans", "1, x"),
    ({"banned_strings": ["b" * 5000]}, "banned_strings", "5000"),
    ({"loras": "x"}, "loras", "x"),
    ({"loras": {"../secret": 1}}, "loras", "../secret"),
    ({"loras": ["../../etc/passwd"]}, "loras", "../../etc/passwd"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("changes", "param", "text"), BAD_COMPLETIONS, ids=repr)
def test_bad_completion_fields(
    server: ApiServer, changes: dict, param: str, text: str, stream: bool
) -> None:
    error = _error(_post(server, "/completions", {**COMPLETION, "stream": stream, **changes}), 400)
    if "stream" in changes:
        assert error["param"] == "stream"
    else:
        assert error["param"] == param, error
    assert text in error["message"], error
    assert error["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": "hi"}, "messages", "hi"),
    ({"messages": [{"content": "x"}]}, "messages.0.role", "required"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages.0.role", "5"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "wizard"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content", "7"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content",
     "image_url"),
    ({"messages": [{"role": "user", "content": "x\udfffy"}]}, "messages.0.content", "surrogate"),
    ({"messages": [{"role": "user", "content": "fox " * 2000}]}, "messages", "the context"),
    ({"max_completion_tokens": -3}, "max_tokens", "-3"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs", "50"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format.json_schema.schema", "strin"),
    ({"grammar_string": 'root ::= "a" missing'}, "grammar_string", "missing"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "does not take tools"),  # the tiny model's chat template has no place for them
    ({"temperature": NAN}, "temperature", "nan"),
    ({"logit_bias": {"3": INF}}, "logit_bias", "inf"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "param", "text"), BAD_CHATS, ids=repr)
def test_bad_chat_fields(server: ApiServer, changes: dict, param: str, text: str) -> None:
    error = _error(_post(server, "/chat/completions", {**CHAT, **changes}), 400)
    assert error["param"] == param and text in error["message"], error


def test_unknown_and_traversing_model_names(server: ApiServer, manager: ModelManager) -> None:
    for name in ("gpt-4", "../tiny", "../secret", "/etc/passwd", "tiny/../../secret", "m" * 10**5):
        error = _error(_post(server, "/completions", {**COMPLETION, "model": name}), 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"
        assert name[:50] in error["message"]
    for name in ("../secret", "/etc", "..", "a/b", "x\x00y", "nope"):
        shown = repr(name)[1:-1]  # a NUL byte is shown escaped
        error = _error(_post(server, "/internal/model/load", {"model_name": name}), 404)
        assert error["param"] == "model_name" and shown in error["message"], error
        error = _error(_post(server, "/internal/lora/load", {"lora_names": [name]}), 404)
        assert error["param"] == "lora_names" and shown in error["message"], error
    two_weights = {"lora_names": ["a"], "lora_weights": [1, 2]}
    error = _error(_post(server, "/internal/lora/load", two_weights), 400)
    assert error["param"] == "lora_weights"
    assert manager.name == "tiny"  # nothing was loaded or unloaded
    missing = httpx.get(f"{server.url}/v1/models/..%2F..%2Fetc")
    assert _error(missing, 404)["type"] in ("not_found_error", "invalid_request_error")


RAW_BODIES = [
    (b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}', "not valid UTF-8: byte 0xff"),
    (b'{"model": "tiny", "prompt": "\xc3(", "max_tokens": 2}', "not valid UTF-8: byte 0xc3"),
    (b'{"model": "tiny", "prompt": ', "malformed JSON"),
    (b'{"model": "tiny", "prompt": "x",}', "malformed JSON"),
    (b"\x00\x01\x02", "malformed JSON"),
    (b"", "body"),
    (b"null", "body"),
    (b"[1, 2]", "body"),
    (b'"just a string"', "body"),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "surrogate"),
    (b'{"prompt": "x", "temperature": NaN}', "nan"),
    (b'{"prompt": "x", "max_tokens": 1e999}', "max_tokens"),
]


@pytest.mark.parametrize(("raw", "text"), RAW_BODIES, ids=repr)
def test_raw_bodies(server: ApiServer, raw: bytes, text: str) -> None:
    error = _error(_post(server, "/completions", raw=raw), 400)
    assert text in error["message"], error


def test_oversized_bodies_are_refused_before_generation(server: ApiServer) -> None:
    size = DEFAULT_MAX_BODY_BYTES + 1024
    body = b'{"prompt": "' + b"a" * size + b'"}'
    error = _error(_post(server, "/completions", raw=body), 413)
    assert error["code"] == "request_too_large" and str(DEFAULT_MAX_BODY_BYTES) in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(size // 2**20 + 1):
            yield b"a" * 2**20
        yield b'"}'

    chunked = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    assert _error(chunked, 413)["code"] == "request_too_large"


def test_openai_client_gets_typed_errors(client: openai.OpenAI) -> None:
    user = [{"role": "user", "content": "x"}]
    completion_args = [
        ({"temperature": -2}, "temperature"),
        ({"top_p": 7}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -9}, "max_tokens"),
        ({"stop": [f"s{i}" for i in range(300)]}, "stop"),
    ]
    for args, param in completion_args:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="tiny", prompt="x", **args)
        assert bad.value.status_code == 400 and bad.value.body["param"] == param, bad.value.body
    chat_args = [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": user, "logit_bias": {"1": 500}}, "logit_bias"),
    ]
    for args, param in chat_args:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny", **args)
        assert bad.value.body["param"] == param, bad.value.body
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="../tiny", prompt="x")
    assert missing.value.body["code"] == "model_not_found"


def test_empty_prompt_text_and_huge_max_tokens_are_served(server: ApiServer) -> None:
    # "" still has the BOS token; a max_tokens beyond the context is clamped to it.
    empty = _post(server, "/completions", {**COMPLETION, "prompt": ""})
    assert empty.status_code == 200 and empty.json()["usage"]["prompt_tokens"] == 1
    no_bos = _post(server, "/completions", {**COMPLETION, "prompt": "", "add_bos_token": False})
    error = _error(no_bos, 400)
    assert error["param"] == "prompt" and error["code"] == "empty_prompt"
    huge = {**COMPLETION, "prompt": [7] * 250, "max_tokens": 10**30, "ban_eos_token": True}
    out = _post(server, "/completions", huge)
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "length"
    assert out.json()["usage"]["completion_tokens"] == 6  # up to the context's 256


def test_server_still_serves_after_everything(server: ApiServer, manager: ModelManager) -> None:
    _still_serves(server, manager)


# -- hypothesis: sampler fields through the API ---------------------------------------------
try:
    import hypothesis
    from hypothesis import strategies as st
except ImportError:  # requirements-dev.txt has it; the tests above run without it
    hypothesis = None

if hypothesis is None:

    def test_fuzzed_sampler_fields_are_served_or_refused() -> None:
        pytest.skip("hypothesis is not installed (requirements-dev.txt)")

else:
    FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "n", "seed",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "typical_p",
              "mirostat_mode", "mirostat_tau", "dry_multiplier", "dry_allowed_length"]  # fmt: skip
    VALUES = st.one_of(
        st.floats(min_value=0, max_value=2),
        st.integers(min_value=-2, max_value=3),
        st.sampled_from([NAN, INF, -INF, 1e39, -1e300, 2**63, 2**70, 1e-320, "1", None, [], {}]),
    )

    @hypothesis.settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
    )
    @hypothesis.given(
        fields=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4), stream=st.booleans()
    )
    def test_fuzzed_sampler_fields_are_served_or_refused(
        server: ApiServer, manager: ModelManager, fields: dict, stream: bool
    ) -> None:
        body = {**COMPLETION, **fields, "stream": stream}
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
            body["max_tokens"] = 3  # keep each example short
        response = _post(server, "/completions", body)
        if response.status_code == 200:
            hypothesis.event("served")
            if stream:
                lines = [line for line in response.text.splitlines() if line.startswith("data:")]
                assert lines[-1] == "data: [DONE]" and '"error"' not in response.text
            return
        hypothesis.event("refused")
        error = _error(response, 400)
        assert error["param"] in {*FIELDS, "max_tokens"}, error
        assert error["param"] in fields or error["param"] == "max_tokens"
        stats = manager.current().backend.scheduler.stats()
        assert stats["running"] == 0


def test_stream_events_survive_line_splitting_clients() -> None:
    # Generated text may hold U+2028/U+2029/U+0085, which JSON leaves raw and str.splitlines()
    # (httpx's aiter_lines, many SSE readers) takes for line breaks.
    from extensions.openai.generation import _sse

    text = "a\u2028b\x85c\u2029d\ne"
    event = _sse({"text": text}).decode()
    lines = event.splitlines()
    assert lines == [lines[0], ""] and json.loads(lines[0][len("data: ") :]) == {"text": text}


# -- capacity and memory faults through the API --------------------------------------------
def test_more_requests_than_batch_and_cache_are_queued(
    server: ApiServer, manager: ModelManager
) -> None:
    # 16 concurrent requests on max_batch 8 and a 512-token cache: they wait or are
    # preempted, and every one is answered in full.
    from concurrent.futures import ThreadPoolExecutor

    body = {**COMPLETION, "max_tokens": 40, "ban_eos_token": True}

    def one(i: int) -> httpx.Response:
        return _post(server, "/completions", {**body, "prompt": [5 + i] * (30 + 2 * i)})

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(one, range(16)))
    assert [r.status_code for r in responses] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in responses)
    _still_serves(server, manager)


def test_out_of_memory_fails_one_request_with_503(server: ApiServer, manager: ModelManager):
    import threading

    import torch

    model = manager.current().backend.model
    real = model.forward
    raised = threading.Event()

    def forward(batch, cache):  # a big prefill step runs out of memory, once
        if not raised.is_set() and batch.token_ids.numel() > 150:
            raised.set()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(batch, cache)

    small = {**COMPLETION, "max_tokens": 30, "ban_eos_token": True, "stream": True}
    model.forward = forward
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=small, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it is running
            big = _post(server, "/completions", {**COMPLETION, "prompt": [9] * 200})
            rest = [line for line in lines if line.startswith("data:")]
    finally:
        del model.forward
    error = _error(big, 503)
    assert error["code"] == "out_of_memory" and "ran out of memory" in error["message"]
    assert raised.is_set() and rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)
    finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
    assert finishes[-1] == "length"  # the running stream went on to its end
    _still_serves(server, manager)
