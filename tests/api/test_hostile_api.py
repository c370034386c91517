"""Hostile requests against the real API server (issue 26): the same requests that used to
start thousands of threads, stall every route, unload the model cross-site, answer 500 and
drop the connection, or freeze the server on a downloaded template or adapter. Each must
be a 4xx naming the field, and other routes must keep answering while it is in flight.

A tiny random Llama on the kestrel loader, uvicorn on loopback in a background thread;
requests through httpx and the `openai` client. No timing assertions: "keeps answering"
is checked by a request to /v1/models that completes while the hostile one is still
pending (generous timeouts for a loaded 2-core machine).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.engine import EngineOptions
from extensions.openai import ApiServer, run_api_server
from extensions.openai import runner as choice_runner
from helpers.hostile_server import (
    LOOP_TEMPLATE,
    TOOL_CALL_TEMPLATE,
    free_port,
    set_template,
    wait_up,
)
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from serving import shared

ROOT = Path(__file__).resolve().parents[2]
LOAD_OPTIONS = dict(
    device="cpu", dtype="float32", page_size=16, cache_tokens=1024, max_seq_len=256, max_batch=8
)  # fmt: skip
JSON = {"content-type": "application/json"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hostile-api")
    make_tiny_llama(root / "models" / "tiny")
    set_template(root / "models" / "tiny", TOOL_CALL_TEMPLATE)
    loras = root / "loras"
    # An adapter_config.json whose rank_pattern backtracks exponentially on module names.
    evil = loras / "evil"
    evil.mkdir(parents=True)
    (evil / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 4,
                "lora_alpha": 8,
                "target_modules": ["q_proj"],
                "rank_pattern": {"([a-z_.0-9]+)+!": 8},
            }
        )
    )
    return root / "models", loras


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


def _post(server: ApiServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = {**JSON, **kw.pop("headers", {})}
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=120, **kw)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]


def _models_answer(server: ApiServer) -> bool:
    return httpx.get(f"{server.url}/v1/models", timeout=60).status_code == 200


def answered_while_pending(
    hostile: Callable[[], httpx.Response], server: ApiServer
) -> tuple[httpx.Response, int]:
    """Runs `hostile` in a thread and asks /v1/models meanwhile; returns its response and
    how many /v1/models requests completed (200) while it was still pending."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(_catch(hostile)), daemon=True)
    thread.start()
    answered = 0
    while thread.is_alive():
        ok = _models_answer(server)
        if thread.is_alive():  # completed before the hostile request did
            assert ok, "/v1/models failed while a hostile request was in flight"
            answered += 1
        time.sleep(0.05)
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0], answered


def _catch(func: Callable[[], Any]) -> Any:
    try:
        return func()
    except BaseException as error:  # re-raised in the test's thread
        return error


def _api_threads() -> int:
    return sum(t.name.startswith("api-choice") for t in threading.enumerate())


# -- 1. threads ------------------------------------------------------------------------------
def test_prompts_times_n_is_capped_without_starting_threads(server: ApiServer) -> None:
    before = _api_threads()
    body = {"model": "tiny", "prompt": ["hi"] * 100, "n": 128, "max_tokens": 1}
    error = _error(_post(server, "/v1/completions", body), 400)
    assert error["param"] == "prompt" and error["code"] == "too_many_choices"
    assert "12800 choices" in error["message"]
    error = _error(_post(server, "/v1/completions", {**body, "prompt": ["hi"] * 2000, "n": 1}), 400)
    assert error["code"] == "too_many_choices"
    assert _api_threads() == before  # refused before any thread started
    ok = _post(server, "/v1/completions", {**body, "prompt": ["hi"] * 4, "n": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8


def test_choice_threads_past_the_server_limit_are_a_429(server: ApiServer) -> None:
    limit = choice_runner.slots.limit
    choice_runner.slots.limit = choice_runner.slots.used + 4
    try:
        body = {"model": "tiny", "prompt": "hi", "n": 8, "max_tokens": 1}
        error = _error(_post(server, "/v1/completions", body), 429)
        assert error["code"] == "too_many_requests"
        assert _post(server, "/v1/completions", {**body, "n": 2}).status_code == 200
    finally:
        choice_runner.slots.limit = limit
    assert choice_runner.slots.used == 0


# -- 2. oversized prompts --------------------------------------------------------------------
def test_a_10mb_prompt_is_refused_by_size_while_models_answers(server: ApiServer) -> None:
    prompt = "hello " * 1_700_000
    response, _ = answered_while_pending(
        lambda: _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt}), server
    )
    error = _error(response, 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert "without tokenizing" in error["message"]
    big = [{"role": "user", "content": "hello " * 1_000_000}]
    error = _error(_post(server, "/v1/chat/completions", {"messages": big}), 400)
    assert error["param"] == "messages" and "without tokenizing" in error["message"]
    error = _error(_post(server, "/v1/embeddings", {"input": [prompt]}), 400)
    assert error["param"] == "input" and "without tokenizing" in error["message"]


def test_tokenizing_lets_other_threads_run(manager: ModelManager) -> None:
    """The tokenizer releases the GIL: the event loop's thread is not stopped for seconds
    by a large prompt being tokenized in a choice thread."""
    model = manager.current()
    text = "The quick brown fox " * 100_000
    done = threading.Event()
    ticks = 0
    worker = threading.Thread(target=lambda: (model.encode(text), done.set()), daemon=True)
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        ticks += 0 if done.is_set() else 1
    worker.join()
    assert ticks >= 3, f"this thread ran {ticks} times while 2 MB were tokenized"


# -- 3. cross-site requests and admin routes -------------------------------------------------
def test_cross_site_posts_are_refused(server: ApiServer, manager: ModelManager) -> None:
    evil = {"origin": "http://evil.example", "content-type": "text/plain"}
    unload = f"{server.url}/v1/internal/model/unload"
    error = _error(httpx.post(unload, content="{}", headers=evil, timeout=60), 403)
    assert error["code"] == "cross_origin" and "evil.example" in error["message"]
    # No Origin (a form post from an old browser, curl) but a body type pages may send
    error = _error(httpx.post(unload, content="{}", headers={"content-type": "text/plain"}), 415)
    assert error["code"] == "unsupported_media_type"
    assert manager.is_loaded() and manager.name == "tiny"
    # The server's own origin (a page it served) and plain JSON clients still work.
    own = {"origin": server.url, **JSON}
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1})
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=own, timeout=60)
    assert response.status_code == 200


def _non_loopback_address() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this picks the route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_admin_routes_need_a_key_from_the_network(
    manager: ModelManager, capfd: pytest.CaptureFixture[str]
) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    running = run_api_server("0.0.0.0", 0, manager=manager)
    try:
        assert "no --api-key" in capfd.readouterr().err  # the start-up warning
        remote = f"http://{address}:{running.port}"
        error = _error(httpx.post(f"{remote}/v1/internal/model/unload", timeout=60), 403)
        assert error["code"] == "admin_key_required"
        assert httpx.get(f"{remote}/v1/internal/model/list", timeout=60).status_code == 403
        assert manager.is_loaded()
        assert httpx.get(f"{remote}/v1/models", timeout=60).status_code == 200
        local = httpx.get(f"{running.url}/v1/internal/lora/list", timeout=60)
        assert local.status_code == 200  # loopback clients keep the admin routes
    finally:
        running.stop()
    keyed = run_api_server("0.0.0.0", 0, manager=manager, api_key="k", admin_key="a")
    try:
        remote = f"http://{address}:{keyed.port}/v1/internal/lora/list"
        auth = {"authorization": "Bearer a"}
        assert httpx.get(remote, headers=auth, timeout=60).status_code == 200
    finally:
        keyed.stop()


def test_openapi_schema_needs_the_key(manager: ModelManager) -> None:
    running = run_api_server("127.0.0.1", 0, manager=manager, api_key="k")
    try:
        assert httpx.get(f"{running.url}/openapi.json", timeout=60).status_code == 401
        auth = {"authorization": "Bearer k"}
        schema = httpx.get(f"{running.url}/openapi.json", headers=auth, timeout=60)
        assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    finally:
        running.stop()


# -- 4. errors are 4xx and the connection stays usable ---------------------------------------
def test_template_errors_are_400_and_the_connection_survives(server: ApiServer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f"}}  # no "arguments"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": "and?"},
    ]
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        bad = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        error = _error(bad, 400)
        assert error["param"] == "messages" and error["code"] == "chat_template_error"
        assert "Undefined" in error["message"]
        good = c.post("/v1/chat/completions", json={"messages": messages[:1], "max_tokens": 1})
        assert good.status_code == 200


def test_deeply_nested_values_are_400_naming_the_field(server: ApiServer) -> None:
    nested = "[" * 3000 + '"x"' + "]" * 3000
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        for body in (
            {"prompt": "hi", "max_tokens": 1, "dry_sequence_breakers": nested},
            {"prompt": "hi", "max_tokens": 1, "custom_stopping_strings": nested},
        ):
            error = _error(c.post("/v1/completions", json=body), 400)
            assert error["param"] in body
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


# -- 5. hostile downloaded files -------------------------------------------------------------
def test_backtracking_lora_pattern_is_refused(server: ApiServer, manager: ModelManager) -> None:
    response, _ = answered_while_pending(
        lambda: _post(server, "/v1/internal/lora/load", {"lora_names": ["evil"]}), server
    )
    error = _error(response, 400)
    assert "rank_pattern" in error["message"] and "exponential" in error["message"]
    assert manager.current().loras() == {}


@pytest.fixture
def loop_template(manager: ModelManager, dirs: tuple[Path, Path]) -> Iterator[None]:
    tokenizer = manager.current().backend.tokenizer
    previous, tokenizer.chat_template = tokenizer.chat_template, LOOP_TEMPLATE
    yield
    tokenizer.chat_template = previous


def test_endless_template_is_stopped_off_the_event_loop(
    server: ApiServer, loop_template: None
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 1}
    response, answered = answered_while_pending(
        lambda: _post(server, "/v1/chat/completions", body), server
    )
    error = _error(response, 400)
    assert error["code"] == "chat_template_error" and "was stopped" in error["message"]
    assert answered >= 1  # the render ran in a thread, for seconds, and /v1/models answered


def test_first_sigterm_stops_the_server_during_a_hostile_render(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    model = tmp_path / "loop"
    make_tiny_llama(model)
    set_template(model, LOOP_TEMPLATE)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "extensions.openai", "--model", str(model), "--port", str(port),
         "--device", "cpu", "--dtype", "float32", "--max-seq-len", "256"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, process)
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        pending = threading.Thread(
            target=_catch,
            args=(lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120),),
            daemon=True,
        )
        pending.start()
        time.sleep(0.5)  # not a timing assertion: the render only needs to have started
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then re-raises the signal it caught (so the exit status says
        # SIGTERM); a process that did not stop would still be running here.
        assert process.wait(timeout=120) in (0, -signal.SIGTERM)
        # uvicorn's own shutdown ran (a request past the grace period is cancelled, and
        # uvicorn logs that), rather than the process dying mid-request.
        assert "Finished server process" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# -- 8. admin inputs -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, param",
    [
        ({"progress": "x"}, "args.progress"),
        ({"self": 1}, "args.self"),
        ({"name": "other"}, "args.name"),
        ({"page_size": 0}, None),
        ({"cache_tokens": 10**12}, None),
    ],
)
def test_bad_load_args_are_refused_before_unloading(
    server: ApiServer, manager: ModelManager, args: dict[str, Any], param: str | None
) -> None:
    model = manager.current()
    body = {"model_name": "tiny", "loader": "kestrel", "args": {**LOAD_OPTIONS, **args}}
    error = _error(_post(server, "/v1/internal/model/load", body), 400)
    assert error["param"] == param and next(iter(args)) in error["message"]
    assert manager.current() is model  # nothing was unloaded
    body["loader"] = None  # auto-detected: checked the same way
    _error(_post(server, "/v1/internal/model/load", body), 400)
    assert manager.current() is model


def test_huge_lora_weight_is_refused(server: ApiServer, manager: ModelManager) -> None:
    for weight in (1e308, float("inf")):
        body = json.dumps({"lora_names": ["evil"], "lora_weights": [weight]})
        error = _error(_post(server, "/v1/internal/lora/load", body), 400)
        assert error["param"] == "lora_weights.0"
    ok = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


# -- 9. a queue limit by default -------------------------------------------------------------
def test_the_queue_has_a_limit_by_default(manager: ModelManager) -> None:
    assert EngineOptions().max_waiting is not None
    assert manager.current().backend.scheduler.max_waiting == EngineOptions().max_waiting


def test_client_leaving_does_not_leak_threads(server: ApiServer) -> None:
    before = _api_threads()
    body = {"prompt": "hi", "max_tokens": 200, "stream": True, "ban_eos_token": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 60
    while _api_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _api_threads() == before and choice_runner.slots.used == 0


def test_openai_client_sees_typed_errors(server: ApiServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="too_many_choices|choices"):
        client.completions.create(model="tiny", prompt=["a"] * 200, n=1, max_tokens=1)
