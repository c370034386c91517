"""The OpenAI-compatible API (extensions/openai) with the real `openai` client.

Servers run on loopback (free ports, background threads) in front of a tiny random Llama
on the kestrel loader; expected texts come from the same model through the loader API.
"""

from __future__ import annotations

import json
import math
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from extensions.openai import ApiServer, run_api_server
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from serving import extensions, shared

LOAD_OPTIONS = dict(
    device="cpu", dtype="float32", page_size=16, cache_tokens=2048, max_batch=32
)  # fmt: skip
GREEDY = {"temperature": 0, "ban_eos_token": True}
# How long a wait may last before the test calls the server stuck: a limit for a hung
# process, far above what a 2-core CPU at load average 8 needs, never a measurement.
LIMIT_S = 300.0


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("api")
    make_tiny_llama(root / "models" / "tiny")
    (root / "loras").mkdir()
    return root / "models", root / "loras"


@pytest.fixture(scope="module")
def manager(dirs: tuple[Path, Path]) -> Iterator[ModelManager]:
    manager = ModelManager(*dirs)
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


@pytest.fixture
def model(manager: ModelManager):
    return manager.current()


def _chat_prompt(model, messages: list[dict]) -> list[int]:
    return model.encode(model.apply_chat_template(messages, add_generation_prompt=True), False)


def _scheduler_idle(model, timeout: float = LIMIT_S) -> dict[str, int]:
    scheduler = model.backend.scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = scheduler.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"scheduler still busy: {scheduler.stats()}")


# -- generation ------------------------------------------------------------------------------
def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "kestrel"


def test_completion(client: openai.OpenAI, model) -> None:
    expected = model.generate("Once upon", {**GREEDY, "max_new_tokens": 10})
    out = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=10, temperature=0,
        extra_body={"ban_eos_token": True},
    )  # fmt: skip
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(model.encode("Once upon"))
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10


def test_completion_stream_with_usage(client: openai.OpenAI, model) -> None:
    expected = model.generate("The quick", {**GREEDY, "max_new_tokens": 12})
    chunks = list(
        client.completions.create(
            model="tiny", prompt="The quick", max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ban_eos_token": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len(chunks) > 3  # streamed, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_and_chat_stream(client: openai.OpenAI, model) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = _chat_prompt(model, messages)
    expected = model.generate(ids, {**GREEDY, "max_new_tokens": 9})
    args = dict(model="tiny", messages=messages, max_tokens=9, temperature=0)
    args["extra_body"] = {"ban_eos_token": True}
    out = client.chat.completions.create(**args)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 9
    stream = client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client: openai.OpenAI, model, stream: bool) -> None:
    full = model.generate("Once upon", {**GREEDY, "max_new_tokens": 12})
    stop = full[6:9]
    assert stop.strip(), f"pick another slice of {full!r}"
    expected = full[: full.index(stop)]
    out = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=12, temperature=0, stop=[stop, "\x00never"],
        stream=stream, extra_body={"ban_eos_token": True},
    )  # fmt: skip
    if stream:
        chunks = list(out)
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    assert text == expected and reason == "stop"


def test_n_choices_seeded(client: openai.OpenAI, model) -> None:
    args = dict(model="tiny", prompt="Kestrels", max_tokens=8, temperature=1.0, seed=1234)
    out = client.completions.create(n=3, **args, extra_body={"ban_eos_token": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    # choice i is the single request with seed + i
    for i, text in enumerate(texts):
        settings = {
            "temperature": 1.0,
            "seed": 1234 + i,
            "max_new_tokens": 8,
            "ban_eos_token": True,
        }
        assert text == model.generate("Kestrels", settings)
    assert len(set(texts)) > 1
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens == len(model.encode("Kestrels"))
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5,
        temperature=0, stream=True, extra_body={"ban_eos_token": True},
    )  # fmt: skip
    by_index: dict[int, str] = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert by_index[0] == by_index[1] != ""  # greedy: both choices alike


def test_completion_logprobs_match_the_model(client: openai.OpenAI, model) -> None:
    out = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ban_eos_token": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    prompt = model.encode("Once upon")
    generated = model.encode(out.choices[0].text, add_bos=False)
    assert len(lp.tokens) == 6 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    logp = torch.log_softmax(model.logits(prompt + generated), dim=-1)
    for i, (token_lp, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        row = logp[len(prompt) - 1 + i]
        assert token_lp == pytest.approx(row.max().item(), abs=1e-4)  # greedy: the best token
        assert len(top) <= 3 and max(top.values()) == pytest.approx(token_lp, abs=1e-6)


def test_echo_prompt_logprobs(client: openai.OpenAI, model) -> None:
    out = client.completions.create(
        model="tiny", prompt="The quick brown", max_tokens=0, echo=True, logprobs=1
    )
    ids = model.encode("The quick brown")
    lp = out.choices[0].logprobs
    assert out.choices[0].text == "The quick brown"
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids)
    logp = torch.log_softmax(model.logits(ids), dim=-1)
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(logp[t - 1, ids[t]].item(), abs=1e-4)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ban_eos_token": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    # the tokens' bytes make up the text (a random model may split a character: U+FFFD)
    joined = bytes(b for item in content for b in item.bytes)
    assert joined.decode(errors="replace") == out.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)
        assert math.isfinite(item.logprob)


def test_sampler_fields_as_extra_body(client: openai.OpenAI, model) -> None:
    # top_k=1 at a high temperature is still the argmax
    expected = model.generate("Once upon", {**GREEDY, "max_new_tokens": 8})
    out = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=8, temperature=3.0, seed=5,
        extra_body={"top_k": 1, "ban_eos_token": True, "sampler_priority": "top_k\ntemperature"},
    )  # fmt: skip
    assert out.choices[0].text == expected
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", extra_body={"min_p": 2})
    assert bad.value.status_code == 400 and "min_p" in bad.value.message
    assert bad.value.body["param"] == "min_p"


# -- errors -----------------------------------------------------------------------------------
def test_bad_requests_get_openai_errors(client: openai.OpenAI, server: ApiServer) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["code"] == "model_not_found" and "gpt-4" in missing.value.message
    with pytest.raises(openai.BadRequestError) as negative:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert negative.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt="fox " * 400, max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_long_stream:
        client.completions.create(model="tiny", prompt="fox " * 400, max_tokens=4, stream=True)
    assert too_long_stream.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bias:
        client.completions.create(model="tiny", prompt="x", logit_bias={"99999": 5})
    assert bias.value.body["param"] == "logit_bias" and "99999" in bias.value.message
    with pytest.raises(openai.BadRequestError) as no_messages:
        client.chat.completions.create(model="tiny", messages=[])
    assert no_messages.value.body["param"] == "messages"
    raw = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert raw.status_code == 400
    error = raw.json()["error"]
    assert error["type"] == "invalid_request_error" and "malformed JSON" in error["message"]
    wrong_type = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "n": "many"})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "n"
    # ... and the server still serves
    out = client.completions.create(model="tiny", prompt="Once", max_tokens=2)
    assert out.usage.completion_tokens <= 2


def test_foreign_host_header_is_refused(server: ApiServer) -> None:
    response = httpx.get(f"{server.url}/v1/models", headers={"host": "evil.example:80"})
    assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error"


def test_no_model_loaded(dirs: tuple[Path, Path]) -> None:
    empty = run_api_server("127.0.0.1", 0, manager=ModelManager(*dirs))
    try:
        client = openai.OpenAI(base_url=f"{empty.url}/v1", api_key="x", max_retries=0)
        assert list(client.models.list()) == []
        with pytest.raises(openai.APIStatusError) as error:
            client.completions.create(model="tiny", prompt="x")
        assert error.value.status_code == 503 and error.value.body["code"] == "model_not_loaded"
    finally:
        empty.stop()


def test_port_in_use_is_a_clear_error(server: ApiServer, manager: ModelManager) -> None:
    from extensions.openai import ApiServerError

    with pytest.raises(ApiServerError, match=f"127.0.0.1:{server.port}"):
        run_api_server("127.0.0.1", server.port, manager=manager)


# -- keys and admin ---------------------------------------------------------------------------
def test_api_key_and_admin_endpoints(dirs: tuple[Path, Path]) -> None:
    own = ModelManager(*dirs)
    keyed = run_api_server("127.0.0.1", 0, api_key="sekrit", admin_key="boss", manager=own)
    url = f"{keyed.url}/v1"
    try:
        for key in ("wrong", ""):
            anon = openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                anon.models.list()
        user = {"authorization": "Bearer sekrit"}
        boss = {"authorization": "Bearer boss"}
        assert httpx.get(f"{url}/internal/model/list", headers=user).status_code == 401
        listed = httpx.get(f"{url}/internal/model/list", headers=boss).json()
        assert listed["model_names"] == ["tiny"]
        for name, status in (("../tiny", 404), ("nope", 404)):
            response = httpx.post(
                f"{url}/internal/model/load", headers=boss, json={"model_name": name}
            )
            assert response.status_code == status, response.text
            assert response.json()["error"]["code"] == "model_not_found"
        bad_option = httpx.post(
            f"{url}/internal/model/load", headers=boss,
            json={"model_name": "tiny", "args": {"warp_drive": True}},
        )  # fmt: skip
        assert bad_option.status_code == 400 and "warp_drive" in bad_option.text
        loaded = httpx.post(
            f"{url}/internal/model/load", headers=boss,
            json={"model_name": "tiny", "args": LOAD_OPTIONS}, timeout=60,
        )  # fmt: skip
        assert loaded.status_code == 200 and loaded.json()["info"]["loader"] == "kestrel"
        client = openai.OpenAI(base_url=url, api_key="sekrit", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices
        info = httpx.get(f"{url}/internal/model/info", headers=user).json()
        assert info["model_name"] == "tiny"
        unloaded = httpx.post(f"{url}/internal/model/unload", headers=boss)
        assert unloaded.status_code == 200 and not own.is_loaded()
        assert list(client.models.list()) == []
    finally:
        keyed.stop()
        own.unload()


def test_lora_endpoints(dirs: tuple[Path, Path], server: ApiServer, model) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    loras = dirs[1]
    if not (loras / "tiny-lora" / "adapter_config.json").is_file():
        base = AutoModelForCausalLM.from_pretrained(dirs[0] / "tiny")
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(loras / "tiny-lora")
    url = f"{server.url}/v1/internal/lora"
    assert httpx.get(f"{url}/list").json() == {"lora_names": ["tiny-lora"]}
    missing = httpx.post(f"{url}/load", json={"lora_names": ["../tiny-lora"]})
    assert missing.status_code == 404
    response = httpx.post(f"{url}/load", json={"lora_names": ["tiny-lora"]}, timeout=60)
    if response.status_code == 501:  # the loader cannot load LoRA adapters (yet)
        assert "LoRA" in response.json()["error"]["message"]
    else:
        assert response.status_code == 200, response.text
        assert "tiny-lora" in model.info()["loras"]
        assert httpx.post(f"{url}/unload", json={}).status_code == 200
        assert not model.info()["loras"]


# -- concurrency and cancellation -------------------------------------------------------------
def test_32_concurrent_streaming_clients(client: openai.OpenAI, model) -> None:
    # 32 tokens each keeps every job alive long enough to overlap with the others, even when
    # a loaded machine staggers the 32 connections.
    prompts = [f"Client {i} says" for i in range(32)]
    expected = [""] * 32
    settings = {**GREEDY, "max_new_tokens": 32, "ban_eos_token": True}
    for chunk in model.stream_many(prompts, settings):
        expected[chunk.job_id] += chunk.text
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(32)

    def run(i: int) -> None:
        try:
            barrier.wait()
            stream = client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=32, temperature=0, stream=True,
                extra_body={"ban_eos_token": True},
            )  # fmt: skip
            results[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except BaseException as error:  # reported below
            errors.append(error)

    scheduler = model.backend.scheduler
    most_running = 0
    done = threading.Event()

    def watch() -> None:  # how many jobs the scheduler runs at once
        nonlocal most_running
        while not done.is_set():
            most_running = max(most_running, scheduler.stats()["running"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    watcher.join()
    assert not errors, errors[:3]
    assert most_running >= 8, f"requests were not batched (at most {most_running} at once)"
    assert [results[i] for i in range(32)] == expected
    stats = _scheduler_idle(model)
    assert stats["free_pages"] == stats["usable_pages"]


def test_disconnect_cancels_the_job(server: ApiServer, model) -> None:
    scheduler = model.backend.scheduler
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 220, "stream": True}
    body.update(GREEDY)
    jobs = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert json.loads(data[0][5:])["choices"][0]["finish_reason"] is None
        jobs = list(scheduler._running)
        assert len(jobs) == 1
    # the connection is closed: the job must end early, cancelled, with its pages freed
    stats = _scheduler_idle(model)
    assert jobs[0].finish_reason == "cancelled"
    assert len(jobs[0].generated_ids) < 220
    assert stats["free_pages"] == stats["usable_pages"]


def test_disconnect_without_streaming_cancels_the_job(server: ApiServer, model) -> None:
    scheduler = model.backend.scheduler
    # Four choices of 220 tokens. The client hangs up once all four run (a raw socket, so the
    # moment is chosen by the scheduler's state, not by a timeout that a busy machine beats).
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 220, "n": 4, **GREEDY}
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    jobs: list = []
    deadline = time.monotonic() + LIMIT_S  # a stuck server, not a measurement
    while len(jobs) < 4 and time.monotonic() < deadline:
        jobs = list(scheduler._running)
        time.sleep(0.002)
    sock.close()  # the client gives up and closes the connection
    stats = _scheduler_idle(model)
    assert len(jobs) == 4
    assert [j.finish_reason for j in jobs] == ["cancelled"] * 4
    assert all(len(j.generated_ids) < 220 for j in jobs)
    assert stats["free_pages"] == stats["usable_pages"]


# -- extensions -------------------------------------------------------------------------------
TAGGER = """
def input_modifier(string, state, is_chat=False):
    return string + " fox"

def output_modifier(string, state, is_chat=False):
    return string + "<end>"
"""


def test_extension_hooks_apply_to_api(tmp_path: Path, client: openai.OpenAI, model) -> None:
    (tmp_path / "tagger").mkdir()
    (tmp_path / "tagger" / "script.py").write_text(textwrap.dedent(TAGGER))
    extensions.load_extensions(["tagger"], tmp_path, strict=True)
    try:
        raw = model.generate("The quick fox", {**GREEDY, "max_new_tokens": 5})
        args = dict(model="tiny", prompt="The quick", max_tokens=5, temperature=0)
        args["extra_body"] = {"ban_eos_token": True}
        out = client.completions.create(**args)
        assert out.choices[0].text == raw + "<end>"
        assert out.usage.prompt_tokens == len(model.encode("The quick fox"))
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**args, stream=True)
        )
        assert streamed == raw + "<end>"
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "The quick"}], max_tokens=5,
            temperature=0, extra_body={"ban_eos_token": True},
        )  # fmt: skip
        ids = _chat_prompt(model, [{"role": "user", "content": "The quick fox"}])
        chat_raw = model.generate(ids, {**GREEDY, "max_new_tokens": 5})
        assert chat.choices[0].message.content == chat_raw + "<end>"
    finally:
        extensions.load_extensions([])
