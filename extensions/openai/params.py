"""OpenAI request fields -> a TGW state dict for serving.text_generation, validated at once.

OpenAI names map to TGW's (max_tokens -> max_new_tokens, stop -> stop, logprobs ->
logprobs); any other field of the body is passed through under its own name, so Kestrel's
and TGW's sampler settings (top_k, min_p, repetition_penalty, dry_*, xtc_*, mirostat_*,
sampler_priority, ...) work as extra body fields. Every value is checked by
SamplingSettings before generation starts; a bad one is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from extensions.openai.errors import ApiError
from extensions.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from extensions.openai.structured import check_constraint_settings, response_format_settings
from loader.errors import SamplingSettingsError
from loader.values import SamplingSettings
from serving import shared

DEFAULT_MAX_TOKENS = 512  # TGW's default max_new_tokens
# Sampling for a request that chooses none (README, "OpenAI-compatible API"). OpenAI's own
# default, temperature 1 with nothing cut, gives word salad on small models (SmolLM2 135M
# at 4 bits: "Kestrel, quinchinna fer a stetlew le mugah..."); 0.7 with min_p 0.1 keeps
# their replies on topic and still varied. A request that sets any of _SAMPLER_CHOICE gets
# exactly what it asked for, the rest off, as in OpenAI's API and TGW's.
API_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.7, "min_p": 0.1}
_SAMPLER_CHOICE = (
    "temperature", "do_sample", "top_p", "top_k", "min_p", "top_a", "typical_p", "tfs",
    "top_n_sigma", "epsilon_cutoff", "eta_cutoff", "xtc_probability", "mirostat_mode",
    "dynamic_temperature", "smoothing_factor",
)  # fmt: skip
# Body fields that are not sampling settings (handled by the endpoints themselves).
_NOT_SETTINGS = {
    "model", "n", "stream", "stream_options", "user", "max_tokens", "max_completion_tokens",
    "prompt", "messages", "echo", "best_of", "suffix", "response_format", "tools",
    "tool_choice", "logprobs", "top_logprobs", "stop", "seed", "mode", "history",
    "stop_event", "parallel_tool_calls", "metadata", "store", "service_tier",
}  # fmt: skip
_OPENAI_SETTINGS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
# OpenAI's message roles ("developer" is the newer name of "system", "function" the older
# name of "tool"); the chat template decides what each becomes.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_text(text: str, param: str) -> str:
    """`text` if it is Unicode text: JSON can carry a lone surrogate ("\\ud800"), which no
    tokenizer takes and no response could echo as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400,
            f"{param} holds a lone surrogate {text[e.start]!r} at character {e.start}: it is "
            "not valid Unicode text (an unpaired \\ud800-\\udfff escape)",
            param=param,
        ) from None
    return text


def build_state(body: SamplingFields) -> dict[str, Any]:
    """The generation state for one request (one choice; `choice_states` varies the seed)."""
    state: dict[str, Any] = {}
    for key, value in (body.model_extra or {}).items():
        if key not in _NOT_SETTINGS:
            state[key] = value
    for key in _OPENAI_SETTINGS:
        value = getattr(body, key)
        if value is not None:
            state[key] = value
    if not any(key in state for key in _SAMPLER_CHOICE):
        state.update(API_SAMPLING_DEFAULTS)
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = shared.settings.get("max_new_tokens", DEFAULT_MAX_TOKENS)
    elif max_tokens < 0:
        raise ApiError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
    state["max_new_tokens"] = max_tokens
    if body.stop is not None:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop)
        state["stop"] = [check_text(s, "stop") for s in stop]
    if body.logit_bias:
        state["logit_bias"] = body.logit_bias
    if body.seed is not None:
        state["seed"] = body.seed
    if isinstance(body, CompletionRequest):
        _check_completion(body)
        if body.logprobs is not None:
            state["logprobs"] = body.logprobs
    if isinstance(body, ChatCompletionRequest):
        state.update(response_format_settings(body.response_format))
        if body.logprobs:
            state["logprobs"] = body.top_logprobs or 0
    try:
        SamplingSettings.from_any(state)
    except SamplingSettingsError as error:
        message = str(error)
        raise ApiError(400, message, param=message.split(" ", 1)[0]) from None
    check_constraint_settings(state)
    return state


def check_logit_bias(state: dict[str, Any], vocab_size: int) -> None:
    """OpenAI refuses biases for tokens the model does not have (the engine would drop them
    silently)."""
    for key in state.get("logit_bias") or {}:
        token = int(key)
        if not 0 <= token < vocab_size:
            raise ApiError(
                400,
                f"logit_bias names token {key}, outside the model's vocabulary [0, {vocab_size})",
                param="logit_bias",
            )


def choice_states(state: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """One state per choice: with a fixed seed, choice i uses seed + i so that the n
    choices differ and the request still reproduces."""
    seed = state.get("seed")
    if n == 1 or seed is None or seed < 0:
        return [dict(state) for _ in range(n)]
    return [{**state, "seed": (seed + i) % 2**64} for i in range(n)]


def _check_completion(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(
            400, "best_of is not supported (leave it out or equal to n)", param="best_of"
        )
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    if isinstance(body.prompt, list) and not body.prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    for text in texts:
        if isinstance(text, str):
            check_text(text, "prompt")


def message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as template input; content parts must be text."""
    messages = []
    for i, message in enumerate(body.messages):
        if message.role not in ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message.role[:100]!r}",
                param=f"messages.{i}.role",
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400,
                        f"messages[{i}].content: only text parts are supported, got "
                        f"{part.get('type')!r}",
                        param=f"messages.{i}.content",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        check_text(content or "", f"messages.{i}.content")
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise ApiError(
                    400,
                    f"messages[{i}].tool_calls: only an assistant message carries tool calls",
                    param=f"messages.{i}.tool_calls",
                )
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return messages
