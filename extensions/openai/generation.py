"""/v1/completions and /v1/chat/completions: requests -> choices -> JSON or SSE.

Every choice (n per prompt) is one job in the model's scheduler, run by `ChoiceRunner`.
Streaming waits for the first chunk before it answers, so errors found when the job is
submitted (prompt too long for the context or the cache, bad settings) are still proper
4xx responses; a later error ends the stream with an `error` event. Usage counts come from
the engine (prompt tokens counted once per prompt, completion tokens over all choices).

With `tools`, a chat reply's tool calls come back as `tool_calls` (extensions/openai/tools.py;
a stream holds back text from where a call may begin).

Output modifiers (extensions) apply to the finished reply, as in TGW: a non-streamed
answer carries the modified text; a streamed one sends raw deltas and, at the end, what the
modifier appended (a modifier that rewrites earlier text cannot recall what was sent).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from extensions.openai.errors import ApiError, error_for
from extensions.openai.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    prompt_logprobs,
)
from extensions.openai.params import (
    build_state,
    check_logit_bias,
    choice_states,
    message_dicts,
)
from extensions.openai.prompt_size import check_prompt_size
from extensions.openai.runner import (
    ChoiceRunner,
    ChunkSource,
    check_choice_count,
    watch_disconnect,
)
from extensions.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from extensions.openai.structured import check_constraint_settings, tool_settings
from extensions.openai.tools import (
    ToolCallStream,
    check_template_takes_tools,
    parse_tool_calls,
    request_tools,
    template_messages,
    tool_names,
)
from loader.base import LoadedModel
from loader.values import CONSTRAINT_ERROR
from serving.text_generation import ReplyChunk, stream_chat_reply, stream_reply

Events = AsyncIterator[tuple[int, ReplyChunk]]


@dataclass
class Choice:
    """What one choice has produced so far."""

    raw: str = ""  # concatenated raw deltas (what a stream has sent)
    text: str = ""  # final text (after output_modifier)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)

    def update(self, chunk: ReplyChunk) -> str:
        """Records the chunk; returns the text to stream for it."""
        self.raw += chunk.delta
        out = chunk.delta
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.completion_tokens = chunk.completion_tokens or self.completion_tokens
        if chunk.finish_reason is not None:
            self.text = chunk.text
            # cancelled (Stop, a disconnect) reads as an ordinary stop to OpenAI clients
            reason = chunk.finish_reason
            self.finish_reason = reason if reason in ("length", CONSTRAINT_ERROR) else "stop"
            if chunk.text.startswith(self.raw):
                out += chunk.text[len(self.raw) :]
        return out


def _usage(choices: list[Choice], n: int) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# Line breaks to str.splitlines() (and so to httpx's aiter_lines and many hand-written SSE
# readers) that JSON leaves raw: generated text holding one would cut an event in two.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_ESCAPE_BREAKS = str.maketrans(_LINE_BREAKS)


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text.translate(_ESCAPE_BREAKS)}\n\n".encode()


class _Request:
    """One API request in flight: its model, its choices, the runner and the stop event."""

    def __init__(self, request: Request, model: LoadedModel, name: str, body: SamplingFields):
        self.request = request
        self.model = model
        self.name = name
        self.body = body
        self.created = int(time.time())
        self.stop = threading.Event()
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.watcher: asyncio.Task[None] | None = None
        self.prompt_param = "prompt" if isinstance(body, CompletionRequest) else "messages"

    def start(self, sources: list[ChunkSource]) -> Events:
        # Watch for a disconnect from now on: a request may wait in the scheduler's queue.
        self.watcher = asyncio.create_task(watch_disconnect(self.request, self.stop))
        return ChoiceRunner(sources, self.stop).chunks()

    def finish(self) -> None:
        self.stop.set()  # cancels whatever still runs (a disconnect, an error, the end)
        if self.watcher is not None:
            self.watcher.cancel()

    async def first(self, events: Events) -> tuple[int, ReplyChunk]:
        """The first chunk of any choice, or the error that stopped them, as an ApiError."""
        try:
            return await events.__anext__()
        except StopAsyncIteration:  # pragma: no cover - every source yields a final chunk
            self.finish()
            raise ApiError(500, "generation produced nothing", type="server_error") from None
        except Exception as error:
            self.finish()
            raise error_for(error, self.prompt_param) from error

    async def collect(
        self,
        events: Events,
        first: tuple[int, ReplyChunk],
        on_chunk: Callable[[int, ReplyChunk], None],
    ) -> None:
        try:
            on_chunk(*first)
            async for index, chunk in events:
                on_chunk(index, chunk)
        except Exception as error:
            raise error_for(error, self.prompt_param) from error
        finally:
            self.finish()

    async def stream(
        self,
        events: Events,
        first: tuple[int, ReplyChunk],
        head: list[bytes],
        render: Callable[[int, ReplyChunk], Iterator[bytes]],
        tail: Callable[[], Iterator[bytes]],
    ) -> AsyncIterator[bytes]:
        try:
            for item in head:
                yield item
            for piece in render(*first):
                yield piece
            async for index, chunk in events:
                for piece in render(index, chunk):
                    yield piece
            for piece in tail():
                yield piece
            yield _sse("[DONE]")
        except Exception as error:  # after the headers: report in-band, then end the stream
            yield _sse(error_for(error, self.prompt_param).body())
            yield _sse("[DONE]")
        finally:
            self.finish()
            await events.aclose()

    def response(self, *args: Any) -> StreamingResponse:
        return StreamingResponse(self.stream(*args), media_type="text/event-stream")


# -- /v1/completions -------------------------------------------------------------------------
def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


async def completions(
    request: Request, body: CompletionRequest, model: LoadedModel, name: str
) -> Any:
    state = build_state(body)
    vocab_size = model.vocab_size
    check_logit_bias(state, vocab_size)
    prompts = _prompts(body)
    check_choice_count(len(prompts), body.n)
    await check_prompt_size(model, prompts, "prompt")  # type: ignore[arg-type]
    for prompt in prompts:
        bad = [t for t in prompt if not 0 <= t < vocab_size] if isinstance(prompt, list) else []
        if bad:
            raise ApiError(
                400,
                f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {vocab_size})",
                param="prompt",
            )
    n = body.n
    req = _Request(request, model, name, body)
    tokenizer = model.tokenizer
    echo = [model.decode(p) if isinstance(p, list) else p for p in prompts] if body.echo else None
    choices = [Choice() for _ in range(len(prompts) * n)]
    logs: list[CompletionLogprobs | None] = [None] * len(choices)
    if body.logprobs is not None:
        for i in range(len(choices)):
            logs[i] = CompletionLogprobs(tokenizer)
        if echo:
            for p, prompt in enumerate(prompts):
                ids = (
                    prompt
                    if isinstance(prompt, list)
                    else await asyncio.to_thread(model.encode, prompt)
                )
                entries = await asyncio.to_thread(prompt_logprobs, model, ids, body.logprobs)
                for j in range(n):
                    logs[p * n + j].add_prompt(ids, entries)  # type: ignore[union-attr]
    sources: list[ChunkSource] = [
        partial(stream_reply, prompt, s, stop_event=req.stop, model=model)
        for prompt in prompts
        for s in choice_states(state, n)
    ]
    events = req.start(sources)
    first = await req.first(events)
    cid = f"cmpl-{uuid.uuid4().hex}"

    def base(choices_out: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "id": cid,
            "object": "text_completion",
            "created": req.created,
            "model": name,
            "choices": choices_out,
        }
        if req.include_usage:
            out["usage"] = None
        return out

    if not body.stream:

        def record(index: int, chunk: ReplyChunk) -> None:
            choices[index].update(chunk)
            if logs[index] is not None and chunk.logprobs:
                logs[index].add(chunk.logprobs)  # type: ignore[union-attr]

        await req.collect(events, first, record)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": req.created,
                "model": name,
                "choices": [
                    {
                        "index": i,
                        "text": (echo[i // n] if echo else "") + c.text,
                        "logprobs": logs[i].as_dict() if logs[i] is not None else None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": _usage(choices, n),
            }
        )

    head = []
    if echo:
        for i in range(len(choices)):
            lp = logs[i].as_dict() if logs[i] is not None else None
            head.append(
                _sse(
                    base(
                        [{"index": i, "text": echo[i // n], "logprobs": lp, "finish_reason": None}]
                    )
                )
            )

    def render(index: int, chunk: ReplyChunk) -> Iterator[bytes]:
        text = choices[index].update(chunk)
        lp = None
        if logs[index] is not None:
            lp = logs[index].add(chunk.logprobs or [])  # type: ignore[union-attr]
        reason = choices[index].finish_reason
        if text or reason or chunk.logprobs:
            item = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
            yield _sse(base([item]))

    def tail() -> Iterator[bytes]:
        if req.include_usage:
            yield _sse({**base([]), "usage": _usage(choices, n)})

    return req.response(events, first, head, render, tail)


# -- /v1/chat/completions --------------------------------------------------------------------
async def chat_completions(
    request: Request, body: ChatCompletionRequest, model: LoadedModel, name: str
) -> Any:
    state = build_state(body)
    check_logit_bias(state, model.vocab_size)
    messages = template_messages(message_dicts(body))
    await check_prompt_size(model, ["".join(m["content"] for m in messages)], "messages")
    tools = request_tools(body.tools, body.tool_choice)
    names = tool_names(tools) if tools else set()
    if tools:  # strict tools, "required" or a named tool: the reply is constrained to a call
        state.update(tool_settings(tools, body.tool_choice))
        check_constraint_settings(state)
    if tools:  # renders the template (time-bounded, engine/chat_template.py): off the loop
        await asyncio.to_thread(check_template_takes_tools, model, messages, tools)
    n = body.n
    req = _Request(request, model, name, body)
    tokenizer = model.tokenizer
    want_logprobs = bool(body.logprobs)
    choices = [Choice() for _ in range(n)]
    sources: list[ChunkSource] = [
        partial(stream_chat_reply, messages, s, stop_event=req.stop, model=model, tools=tools)
        for s in choice_states(state, n)
    ]
    events = req.start(sources)
    first = await req.first(events)
    cid = f"chatcmpl-{uuid.uuid4().hex}"

    if not body.stream:

        def record(index: int, chunk: ReplyChunk) -> None:
            choices[index].update(chunk)
            if want_logprobs and chunk.logprobs:
                choices[index].logprobs += chat_logprobs(tokenizer, chunk.logprobs)

        await req.collect(events, first, record)

        def message(c: Choice) -> tuple[dict[str, Any], str | None]:
            if not tools:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            text, calls = parse_tool_calls(c.text, names)
            if not calls:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            return {"role": "assistant", "content": text or None, "tool_calls": calls}, "tool_calls"

        replies = [message(c) for c in choices]
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": req.created,
                "model": name,
                "choices": [
                    {
                        "index": i,
                        "message": reply,
                        "logprobs": {"content": c.logprobs} if want_logprobs else None,
                        "finish_reason": reason,
                    }
                    for i, (c, (reply, reason)) in enumerate(zip(choices, replies, strict=True))
                ],
                "usage": _usage(choices, n),
            }
        )

    def chunk_body(items: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": req.created,
            "model": name,
            "choices": items,
        }
        if req.include_usage:
            out["usage"] = None
        return out

    head = [
        _sse(
            chunk_body(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        )
        for i in range(n)
    ]

    # With tools, text from where a call may begin is held back (extensions/openai/tools.py).
    held = [ToolCallStream(names) for _ in range(n)] if tools else None

    def render(index: int, chunk: ReplyChunk) -> Iterator[bytes]:
        text = choices[index].update(chunk)
        reason = choices[index].finish_reason
        calls: list[dict[str, Any]] = []
        if held is not None:
            text = held[index].feed(text)
            if reason:
                rest, calls = held[index].finish()
                text += rest
        lp = None
        if want_logprobs and chunk.logprobs:
            lp = {"content": chat_logprobs(tokenizer, chunk.logprobs)}
        if text or lp:
            item = {
                "index": index,
                "delta": {"content": text},
                "logprobs": lp,
                "finish_reason": None,
            }
            yield _sse(chunk_body([item]))
        if calls:
            deltas = [{"index": j, **call} for j, call in enumerate(calls)]
            item = {"index": index, "delta": {"tool_calls": deltas}, "finish_reason": None}
            yield _sse(chunk_body([{**item, "logprobs": None}]))
            reason = "tool_calls"
        if reason:
            item = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
            yield _sse(chunk_body([item]))

    def tail() -> Iterator[bytes]:
        if req.include_usage:
            yield _sse({**chunk_body([]), "usage": _usage(choices, n)})

    return req.response(events, first, head, render, tail)
