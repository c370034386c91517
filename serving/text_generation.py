"""The generation flow that the web UI and the API share (TGW's modules/text_generation.py).

    for text in generate_reply(prompt, state):           # cumulative text, as in TGW
        ...
    for text in generate_chat_reply(messages, state):    # chat: template + hooks
        ...

`state` is a dict of TGW state keys (sampling settings under TGW's names; see
engine/sampling_settings.py). The order of hooks is TGW's:

- text: state_modifier -> input_modifier -> custom_generate_reply or the current model's
  stream -> output_modifier (on the finished reply only, so expensive modifiers such as
  TTS run once; the text streamed before the last item is the raw reply).
- chat: state_modifier -> history_modifier -> input_modifier(last user message,
  is_chat=True) -> chat template + bot_prefix_modifier("") -> generation ->
  output_modifier(reply, is_chat=True).

`stream_reply` / `stream_chat_reply` yield `ReplyChunk`s: the model's own event (`Chunk`,
the one event type from the engine to clients: delta, token ids, logprobs, counts) carried
as it is, plus the reply so far. Generation stops at the request's own `stop_event` (a UI
page's Stop, an API client going away), and only there: there is no process-wide stop, so
the UI and the API never stop each other's requests. The model's stream is then closed,
which cancels the job in the scheduler and frees its cache pages at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from loader.base import Chunk, LoadedModel
from loader.values import SamplingSettings, TokenLogprob
from serving import extensions, shared

# State keys that are the UI's or the flow's, never sampling settings.
_NOT_SAMPLING = ("history", "stop_event", "messages", "stream", "mode")


@dataclass
class ReplyChunk:
    """One step of a reply: the model's event as it came (`chunk`) and the reply so far."""

    chunk: Chunk  # its .text is the delta this step added
    text: str  # the reply so far; on the final chunk after output_modifier (text mode)

    @property
    def delta(self) -> str:
        return self.chunk.text

    @property
    def finish_reason(self) -> str | None:  # "stop", "length" or "cancelled" on the last
        return self.chunk.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return self.chunk.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.chunk.generated_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.chunk.token_ids

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.chunk.logprobs

    @property
    def seed(self) -> int | None:
        return self.chunk.seed


def _ending(chunk: Chunk | None, reason: str) -> Chunk:
    """A final event with no new text that keeps `chunk`'s counts (a stop between tokens)."""
    if chunk is None:
        return Chunk(text="", finish_reason=reason)
    return replace(chunk, text="", token_ids=[], logprobs=None, finish_reason=reason)


def settings_from_state(state: Mapping[str, Any]) -> SamplingSettings:
    """The sampling settings in a TGW state dict (raises SamplingSettingsError)."""
    return SamplingSettings.from_any({k: v for k, v in state.items() if k not in _NOT_SAMPLING})


def _stopped(stop_event: threading.Event | None) -> bool:
    return stop_event is not None and stop_event.is_set()


def stream_reply(
    prompt: str | list[int],
    state: Mapping[str, Any],
    *,
    is_chat: bool = False,
    stop_event: threading.Event | None = None,
    model: LoadedModel | None = None,
) -> Iterator[ReplyChunk]:
    """The reply to `prompt` (text, or token ids that bypass input_modifier) as chunks; the
    last one has a finish_reason."""
    state = dict(state)
    custom = extensions.custom_generate_reply()
    if isinstance(prompt, list) and custom is not None:  # an extension's generator takes text
        prompt = (model or shared.manager.current()).decode(prompt)
    original = prompt
    if not is_chat:
        state = extensions.apply_state_modifier(state)
        if isinstance(prompt, str):
            prompt = extensions.apply_input_modifier(prompt, state)
    chunks: Iterator[ReplyChunk]
    if custom is not None:
        assert isinstance(prompt, str) and isinstance(original, str)  # decoded above
        chunks = _custom_chunks(custom, prompt, original, state, is_chat, stop_event, model)
    else:
        model = model or shared.manager.current()
        chunks = _model_chunks(model, prompt, settings_from_state(state), stop_event)
    for chunk in chunks:
        if chunk.finish_reason is not None and not is_chat:
            chunk.text = extensions.apply_output_modifier(chunk.text, state)
        yield chunk


def _model_chunks(
    model: LoadedModel,
    prompt: str | list[int],
    settings: SamplingSettings,
    stop_event: threading.Event | None,
) -> Iterator[ReplyChunk]:
    stream = model.stream(prompt, settings)
    text, last = "", None
    try:
        while True:
            if _stopped(stop_event):  # checked before the next token is computed
                yield ReplyChunk(_ending(last, "cancelled"), text)
                return
            chunk = next(stream, None)
            if chunk is None:  # a stream always ends with a finish_reason; be safe anyway
                yield ReplyChunk(_ending(last, "stop"), text)
                return
            text, last = text + chunk.text, chunk
            yield ReplyChunk(chunk, text)
            if chunk.finish_reason is not None:
                return
    finally:
        # Closing the model's stream early cancels the job and frees its pages.
        stream.close()


def _custom_chunks(
    custom: Any,
    prompt: str,
    original: str,
    state: dict[str, Any],
    is_chat: bool,
    stop_event: threading.Event | None,
    model: LoadedModel | None,
) -> Iterator[ReplyChunk]:
    # TGW's signature: (question, original_question, state, stopping_strings, is_chat=)
    # yielding the cumulative reply; token counts come from the current model if any.
    if model is None and shared.manager.is_loaded():
        model = shared.manager.current()
    prompt_tokens = len(model.encode(prompt)) if model is not None else 0
    stream = custom(prompt, original, state, settings_from_state(state).stop, is_chat=is_chat)
    text, reason = "", "stop"
    try:
        for reply in stream:
            reply = str(reply)
            delta = reply[len(text) :] if reply.startswith(text) else reply
            text = reply
            yield ReplyChunk(Chunk(text=delta, prompt_tokens=prompt_tokens), text)
            if _stopped(stop_event):
                reason = "cancelled"
                break
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    completion = len(model.encode(text, add_bos=False)) if model is not None else 0
    final = Chunk(
        text="", finish_reason=reason, prompt_tokens=prompt_tokens, generated_tokens=completion
    )
    yield ReplyChunk(final, text)


def generate_reply(
    prompt: str,
    state: Mapping[str, Any],
    *,
    is_chat: bool = False,
    stop_event: threading.Event | None = None,
) -> Iterator[str]:
    """Cumulative reply text, as TGW's generate_reply yields it."""
    for chunk in stream_reply(prompt, state, is_chat=is_chat, stop_event=stop_event):
        yield chunk.text


# -- chat ------------------------------------------------------------------------------------
def prepare_chat(
    messages: list[dict[str, Any]],
    state: Mapping[str, Any],
    *,
    model: LoadedModel | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The prompt for `messages` (OpenAI-style dicts with role and content) and the state
    to generate it with, after state_modifier, history_modifier, input_modifier (on the
    last user message) and bot_prefix_modifier. `tools` (function definitions) go to the
    chat template."""
    model = model or shared.manager.current()
    state = extensions.apply_state_modifier(dict(state))
    history = extensions.apply_history_modifier([dict(m) for m in messages])
    if (
        history
        and history[-1].get("role") == "user"
        and isinstance(history[-1].get("content"), str)
    ):
        history[-1]["content"] = extensions.apply_input_modifier(
            history[-1]["content"], state, is_chat=True
        )
    kwargs = {"tools": tools} if tools else {}
    prompt = model.apply_chat_template(history, add_generation_prompt=True, **kwargs)
    prompt += extensions.apply_bot_prefix_modifier("", state)
    # The template writes the BOS token itself where the model wants one (TGW does this too).
    state["add_bos_token"] = False
    return prompt, state


def stream_chat_reply(
    messages: list[dict[str, Any]],
    state: Mapping[str, Any],
    *,
    stop_event: threading.Event | None = None,
    model: LoadedModel | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Iterator[ReplyChunk]:
    """The assistant's reply to `messages` as chunks; output_modifier on the final one."""
    model = model or shared.manager.current()
    prompt, state = prepare_chat(messages, state, model=model, tools=tools)
    for chunk in stream_reply(prompt, state, is_chat=True, stop_event=stop_event, model=model):
        if chunk.finish_reason is not None:
            chunk.text = extensions.apply_output_modifier(chunk.text, state, is_chat=True)
        yield chunk


def generate_chat_reply(
    messages: list[dict[str, Any]],
    state: Mapping[str, Any],
    *,
    stop_event: threading.Event | None = None,
) -> Iterator[str]:
    """Cumulative assistant reply text for the UI's chat tab."""
    for chunk in stream_chat_reply(messages, state, stop_event=stop_event):
        yield chunk.text
