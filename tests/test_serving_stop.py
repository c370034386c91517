"""Per-request stop: the web UI and the API share one request flow (serving/) and one model,
but a stop belongs to the request that asked for it. The UI stopping its replies (one
session's Stop, or all of them) never ends an API request, and an API client going away
never ends a UI reply. Real paths: the UI's job registry and generation (webui/context.py,
webui/generation.py) and the openai client against the running API app, on one model."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from extensions.openai import ApiServer, run_api_server
from loader.manager import ModelManager
from serving import extensions, shared
from serving.sessions import UserData
from webui.context import AppContext
from webui.generation import Progress, chat_reply

from model_factory import make_tiny_llama

# A context long enough that both replies are still running when a stop is pressed: the
# stop comes right after the second one's first token, thousands of tokens before its end.
CONTEXT = 4096
API_TOKENS = 2000
UI_TOKENS = 3000
# A bound for a hung process, far above what a 2-core CPU at load average 8 needs.
LIMIT_S = 300.0
GREEDY = {"temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppContext]:
    root = tmp_path_factory.mktemp("stop")
    make_tiny_llama(root / "models" / "tiny", max_position_embeddings=CONTEXT)
    (root / "loras").mkdir()
    manager = ModelManager(root / "models", root / "loras")
    manager.load(
        "tiny", "kestrel", device="cpu", dtype="float32", page_size=16,
        cache_tokens=2 * CONTEXT + 64, max_batch=4,
    )  # fmt: skip
    extensions.load_extensions([])
    previous, shared.manager = shared.manager, manager
    yield AppContext(manager, UserData(root / "user_data"))
    shared.manager = previous
    manager.unload()


@pytest.fixture(scope="module")
def server(ctx: AppContext) -> Iterator[ApiServer]:
    running = run_api_server("127.0.0.1", 0, manager=ctx.manager)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: ApiServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


class UiReply:
    """A Chat tab reply of one browser session, run as the tab runs it: a job from the UI's
    registry, webui.generation.chat_reply in a thread of its own."""

    def __init__(self, ctx: AppContext, session: str) -> None:
        job = ctx.start_job(session)
        assert job is not None
        self.ctx, self.job = ctx, job
        self.updates: list[Progress] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(LIMIT_S), "the UI reply produced nothing"

    def _run(self) -> None:
        values = {**GREEDY, "max_new_tokens": UI_TOKENS}
        messages = [{"role": "user", "content": "Tell me a long story."}]
        try:
            for progress in chat_reply(messages, values, self.job.stop):
                self.updates.append(progress)
                if progress.completion_tokens:
                    self.started.set()
        finally:
            self.ctx.end_job(self.job)
            self.started.set()

    def result(self) -> Progress:
        self.thread.join(LIMIT_S)
        assert not self.thread.is_alive(), "the UI reply did not end"
        last = self.updates[-1]
        assert last.error is None, last.error
        return last


def _api_stream(client: openai.OpenAI) -> openai.Stream:
    return client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=API_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ban_eos_token": True},
    )  # fmt: skip


def test_the_ui_stopping_its_replies_leaves_api_requests_running(
    ctx: AppContext, client: openai.OpenAI
) -> None:
    ui = UiReply(ctx, "page-a/chat")
    stream = _api_stream(client)
    chunks = [next(iter(stream))]  # the API request runs: its first token arrived
    ctx.stop(ui.job.session)  # the page's Stop button
    ctx.stop_all()  # every reply of the UI (TGW's stop_everything)
    assert ui.result().finish_reason == "cancelled"
    chunks += list(stream)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length", f"the API request ended early: {reasons[-1]}"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == API_TOKENS


def test_an_api_client_going_away_leaves_ui_replies_running(
    ctx: AppContext, client: openai.OpenAI
) -> None:
    ui = UiReply(ctx, "page-b/chat")
    stream = _api_stream(client)
    next(iter(stream))
    stream.close()  # the client disconnects: the server stops its request
    other = UiReply(ctx, "page-c/chat")  # a second page, stopped by its own Stop
    ctx.stop(other.job.session)
    assert other.result().finish_reason == "cancelled"
    last = ui.result()
    assert last.finish_reason == "length", f"the UI reply ended early: {last.finish_reason}"


STOPPER = """
from modules import shared

def stop_everything():
    # What a TGW extension's button does to end the UI's generation.
    shared.stop_everything = True
"""


def test_a_tgw_extension_stopping_everything_stops_ui_replies_not_api_requests(
    ctx: AppContext, client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ext_dir = tmp_path_factory.mktemp("extensions")
    (ext_dir / "stopper").mkdir()
    (ext_dir / "stopper" / "script.py").write_text(STOPPER)
    previous = shared.stop_all_replies
    shared.stop_all_replies = ctx.stop_all  # what ui.py does at start-up
    try:
        [stopper] = extensions.load_extensions(["stopper"], ext_dir, strict=True)
        ui = UiReply(ctx, "page-d/chat")
        stream = _api_stream(client)
        chunks = [next(iter(stream))]
        stopper.module.stop_everything()
        assert ui.result().finish_reason == "cancelled"
        from modules import shared as tgw_shared  # the shim the extension imported

        assert tgw_shared.stop_everything is True and shared.stop_everything is True
        chunks += list(stream)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "length", f"the API request ended early: {reasons[-1]}"
        # The UI's next reply clears the flag (as TGW's generation does) and runs.
        job = ctx.start_job("page-d/chat")
        assert job is not None and tgw_shared.stop_everything is False
        ctx.end_job(job)
    finally:
        shared.stop_all_replies = previous
        extensions.load_extensions([])


def test_a_closed_page_leaves_no_per_session_state(ctx: AppContext) -> None:
    for tab in ("chat", "notebook"):
        job = ctx.start_job(f"page-e/{tab}")
        assert job is not None
        ctx.end_job(job)
    other = ctx.start_job("page-f/chat")
    assert other is not None
    ctx.end_job(other)
    assert ctx.ended_jobs("page-e/chat") == 1 and ctx.ended_jobs("page-e/notebook") == 1
    ctx.forget_session("page-e")  # Gradio's unload event for that page
    assert ctx.ended_jobs("page-e/chat") == 0 and ctx.ended_jobs("page-e/notebook") == 0
    assert ctx.ended_jobs("page-f/chat") == 1
