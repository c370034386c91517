"""What the Chat and Notebook tabs run: the shared generation flow (serving.text_generation,
where extensions apply; serving.prompt_fit fits the prompt into the context) plus what only
the UI does — continuing a reply, the pace of page updates and the speed line under the
output.

`state` is the Parameters tab's values (webui.sampler_controls). Every function yields
`Progress`: the cumulative reply text and a one-line status
("12 tokens, 48.3 tok/s"). Errors are not raised into Gradio: they end the stream with the
message in `error`, so the page shows it next to the output.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loader.base import Chunk, LoadedModel
from serving import shared
from serving.prompt_fit import Message, budget, fit_messages
from serving.text_generation import (
    ReplyChunk,
    prepare_chat,
    settings_from_state,
    stream_chat_reply,
    stream_reply,
)
from webui.sampler_controls import state_from_values

# A streamed page update costs a message and a re-render in the browser. Sent 20 times a
# second, a 3000-token reply of the test model (9.3 s) cost headless Chromium 4.7 s of main
# thread, half a core; on a 2-core machine at load 8 the browser gets about a quarter of
# one, so the page fell further and further behind the server, and a Stop pressed on what
# the page showed reached a server that had already finished ("3000 tokens ... length").
# At most 10 updates a second, and fewer as the reply grows (the browser re-renders the
# whole reply each time: at most this many characters a second), cost 3.0 s for the same
# reply. The text shown is never more than 0.1 s (short replies) behind.
MIN_UPDATE_SECONDS = 0.1
RENDERED_CHARS_PER_SECOND = 20_000


def update_interval(text_length: int) -> float:
    """Seconds between two page updates of a reply `text_length` characters long."""
    return max(MIN_UPDATE_SECONDS, text_length / RENDERED_CHARS_PER_SECOND)


@dataclass
class Progress:
    """What the page shows of a reply: its text, the status line, an error. The counts are
    the model's last event's (`chunk`), read through, not copied."""

    text: str
    status: str
    done: bool = False
    error: str | None = None
    chunk: Chunk | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.chunk.finish_reason if self.chunk is not None else None

    @property
    def completion_tokens(self) -> int:
        return self.chunk.generated_tokens if self.chunk is not None else 0

    @property
    def prompt_tokens(self) -> int:
        return self.chunk.prompt_tokens if self.chunk is not None else 0


def _status(chunk: ReplyChunk, started: float, first: float | None, prefix: str = "") -> str:
    elapsed = time.perf_counter() - started
    decode = time.perf_counter() - first if first is not None else 0.0
    speed = (
        (chunk.completion_tokens - 1) / decode if decode > 0 and chunk.completion_tokens > 1 else 0
    )
    parts = [f"{chunk.completion_tokens} tokens", f"{speed:.1f} tok/s"]
    if chunk.prompt_tokens:
        parts.append(f"prompt {chunk.prompt_tokens} tokens")
    parts.append(f"{elapsed:.1f} s")
    if chunk.finish_reason:
        parts.append({"cancelled": "stopped"}.get(chunk.finish_reason, chunk.finish_reason))
    return prefix + ", ".join(parts)


def ignored_note(state: dict[str, Any]) -> str:
    """A status prefix naming settings that are set but not implemented here (mirostat_mode
    1, TGW-only keys), so that they never pass silently."""
    try:
        keys = settings_from_state(state).unsupported()
    except Exception:  # a bad value fails, by name, where the settings are used
        return ""
    return f"ignored (not implemented): {', '.join(keys)}; " if keys else ""


def _follow(chunks: Iterator[ReplyChunk], base: str = "", prefix: str = "") -> Iterator[Progress]:
    started = time.perf_counter()
    first: float | None = None
    last_update = 0.0
    try:
        for chunk in chunks:
            if first is None and chunk.completion_tokens:
                first = time.perf_counter()
            now = time.perf_counter()
            due = update_interval(len(base) + len(chunk.text))
            if chunk.finish_reason is None and now - last_update < due:
                continue
            last_update = now
            yield Progress(
                base + chunk.text,
                _status(chunk, started, first, prefix),
                done=chunk.finish_reason is not None,
                chunk=chunk.chunk,
            )
    except Exception as e:  # shown in the page; the server and the other sessions go on
        yield Progress(base, f"error: {e}", done=True, error=f"{type(e).__name__}: {e}")


def _model_or_error() -> LoadedModel | Progress:
    if not shared.manager.is_loaded():
        from webui.startup import preparation_status

        preparing = preparation_status()
        return Progress(
            "",
            "no model is loaded",
            done=True,
            error=preparing or "Load a model first (Model tab).",
        )
    return shared.manager.current()


def chat_reply(
    messages: list[Message], state: dict[str, Any], stop_event: threading.Event
) -> Iterator[Progress]:
    """The assistant's reply to `messages` (the last one is the user's)."""
    model = _model_or_error()
    if isinstance(model, Progress):
        yield model
        return
    try:
        state = state_from_values(state)
        limit, new = budget(model, state)
        fitted = fit_messages(model, messages, limit)
    except Exception as e:
        yield Progress("", f"error: {e}", done=True, error=f"{type(e).__name__}: {e}")
        return
    state = {**state, "max_new_tokens": new}
    chunks = stream_chat_reply(fitted, state, stop_event=stop_event, model=model)
    yield from _follow(chunks, prefix=ignored_note(state))


def continue_reply(
    messages: list[Message], state: dict[str, Any], stop_event: threading.Event
) -> Iterator[Progress]:
    """More of the last assistant message: the prompt is the chat up to it plus its text,
    and the new text is appended to it."""
    model = _model_or_error()
    if isinstance(model, Progress):
        yield model
        return
    last = messages[-1]["content"]
    try:
        state = state_from_values(state)
        limit, new = budget(model, state)
        fitted = fit_messages(model, messages[:-1], limit - len(model.encode(last, add_bos=False)))
        prompt, chat_state = prepare_chat(fitted, state, model=model)
    except Exception as e:
        yield Progress(last, f"error: {e}", done=True, error=f"{type(e).__name__}: {e}")
        return
    chat_state["max_new_tokens"] = new
    chunks = stream_reply(
        prompt + last, chat_state, is_chat=True, stop_event=stop_event, model=model
    )
    yield from _follow(chunks, base=last, prefix=ignored_note(chat_state))


def complete(prompt: str, state: dict[str, Any], stop_event: threading.Event) -> Iterator[Progress]:
    """Raw completion (the Notebook tab): the text continues `prompt`; a prompt longer than
    the budget loses its beginning, not its end."""
    model = _model_or_error()
    if isinstance(model, Progress):
        yield model
        return
    try:
        state = state_from_values(state)
        limit, new = budget(model, state)
        ids = model.encode(prompt, add_bos=False)
        if len(ids) > limit:
            prompt = model.decode(ids[-limit:])
    except Exception as e:
        yield Progress("", f"error: {e}", done=True, error=f"{type(e).__name__}: {e}")
        return
    state = {**state, "max_new_tokens": new}
    chunks = stream_reply(prompt, state, stop_event=stop_event, model=model)
    yield from _follow(chunks, prefix=ignored_note(state))
