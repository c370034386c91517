"""Function calling for /v1/chat/completions: the request's tools go into the model's chat
template, and the tool calls the model writes come back as OpenAI `tool_calls`.

Models write calls in their own formats; the ones recognised here cover the common chat
templates:
- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes,
  Qwen 2.5/3 and many fine-tunes);
- `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral);
- `<|python_tag|>{"name": ..., "parameters": {...}}`, several joined by ";" (Llama 3.1);
- a reply that is nothing but such a JSON object or list of them, possibly in a ```json
  fence (Llama 3.2 and others).
Only calls to tools the request declared count; anything else stays text. tool_choice
"required", a named function and tools with `"strict": true` constrain the reply
(extensions/openai/structured.py) so that a call's arguments validate against its tool's
parameters.

Streaming holds back text from the point where a call may start (a marker, or a reply that
opens with JSON) and sends the calls, and any text around them, when the reply ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from extensions.openai.errors import ApiError, error_for

# Where a call starts in the formats above (the bare-JSON form has no marker).
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_JSON_FENCE = "```json"


def request_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict] | None:
    """The request's tools as the chat template takes them (OpenAI's {"type": "function",
    "function": {...}} entries), or None when there are none or tool_choice is "none";
    a 400 naming the field for anything malformed or unsupported."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if tool_choice == "none":
        return None
    named = (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    )
    if tool_choice not in (None, "auto", "required") and not named:
        raise ApiError(
            400,
            f"tool_choice {json.dumps(tool_choice)[:100]} is not supported: use 'auto', "
            '\'none\', \'required\' or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, f"{where}.type must be 'function'", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ApiError(400, f"{where}.function must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(
                400,
                f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', "
                f"got {json.dumps(name)[:100]}",
                param=f"{where}.function.name",
            )
        if name in names:
            raise ApiError(400, f"tool {name!r} is declared twice", param=f"{where}.function.name")
        names.add(name)
        if "strict" in function and not isinstance(function["strict"], bool):
            raise ApiError(
                400,
                f"{where}.function.strict must be true or false",
                param=f"{where}.function.strict",
            )
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ApiError(
                400,
                f"{where}.function.parameters must be a JSON schema object",
                param=f"{where}.function.parameters",
            )
    return tools


def tool_names(tools: list[dict[str, Any]]) -> set[str]:
    return {tool["function"]["name"] for tool in tools}


def _call(item: Any, names: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool call from one parsed JSON object, if it names a declared tool."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": item["name"], "arguments": arguments},
    }


def _calls_in_json(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """Calls from text that is one JSON object or a list of them (every one a declared
    tool's call), else None."""
    fenced = _FENCE.match(text.strip())
    text = fenced.group(1) if fenced else text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """(the text that is not a call, the calls) of a finished reply. A reply without a
    recognisable call to a declared tool comes back whole, with no calls."""
    if "<tool_call>" in text:
        calls = []
        for match in _TAGGED.finditer(text):
            found = _calls_in_json(match.group(1), names)
            if found is None:
                return text, []
            calls += found
        return _TAGGED.sub("", text).strip(), calls
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        if marker in text:
            before, _, after = text.partition(marker)
            parts = [after] if marker == "[TOOL_CALLS]" else after.split(";")
            calls = []
            for part in parts:
                found = _calls_in_json(part, names)
                if found is None:
                    return text, []
                calls += found
            return before.strip(), calls
    found = _calls_in_json(text, names)
    return ("", found) if found else (text, [])


@dataclass
class ToolCallStream:
    """What a streamed reply may send now when its tools are active: text up to where a
    call may begin is sent; from there on it is held until `finish`."""

    names: set[str]
    sent: str = ""
    held: str = ""
    holding: bool = False
    # Text held back until it is clear whether a call starts there (the first characters
    # of a marker, leading white space, the start of a ```json fence).
    _pending: str = field(default="", repr=False)

    def feed(self, delta: str) -> str:
        """The part of `delta` (with anything held back before) that can be sent."""
        if self.holding:
            self.held += delta
            return ""
        text = self._pending + delta
        self._pending = ""
        starts = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
        if starts:
            cut = min(starts)
            self.held, self.holding = text[cut:], True
            return self._send(text[:cut])
        if not self.sent.strip():
            # The reply so far may still open a bare JSON call: hold it if it does, wait
            # while it cannot tell yet (whitespace, the start of a ```json fence).
            opening = text.lstrip()
            if opening[:1] in ("{", "[") or opening.startswith(_JSON_FENCE):
                self.held, self.holding = text, True
                return ""
            if _JSON_FENCE.startswith(opening):
                self._pending = text
                return ""
        keep = _marker_prefix(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return self._send(text[: len(text) - keep])

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(text still to send, the calls) once the reply has ended."""
        rest = self._pending + self.held
        self._pending = self.held = ""
        if not rest:
            return "", []
        return parse_tool_calls(rest, self.names)

    def _send(self, text: str) -> str:
        self.sent += text
        return text


def _marker_prefix(text: str) -> int:
    """The length of the longest end of `text` that begins some marker."""
    best = 0
    for marker in MARKERS:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's tool calls with their
    arguments as objects (OpenAI sends JSON strings; templates write `arguments | tojson`
    or iterate over them)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_template_call(call) for call in calls]}
        out.append(message)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(call.get("function"), dict):
        return call  # not OpenAI's shape: the template gets it as sent
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the string as sent
    return {**call, "function": function}


def check_template_takes_tools(
    model: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> None:
    """A 400 when the model's chat template renders the same prompt with and without the
    tools: it has no place for them, and the model would never learn of them."""
    try:
        with_tools = model.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        without = model.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as error:
        raise error_for(error) from error
    if with_tools == without:
        raise ApiError(
            400,
            "this model's chat template does not take tools (it renders the same prompt "
            "without them), so the model would never see them; use a model whose template "
            "supports tool use, or leave tools out",
            param="tools",
        )
