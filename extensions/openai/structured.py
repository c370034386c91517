"""Structured output for the API: `response_format` and strict tools -> the engine's
constraint settings (engine/constraints through loader.values), checked before generation.

- `response_format` {"type": "json_object"}: any JSON object; {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}: output that validates against the schema
  (constrained whether or not `strict` is set: the engine has no looser mode).
- `tools` whose function says `"strict": true`, or `tool_choice` "required" or a named
  function: the reply is constrained to a call, a JSON object {"name": ..., "arguments":
  {...}} whose arguments validate against that tool's parameters (tools/parse_tool_calls
  reads it back as `tool_calls`). With "auto" and strict tools the reply is either such a
  call or plain text that opens with neither "{", "[", "<" nor white space and holds no
  tool-call marker, so that nothing unchecked reads as a call.
- Kestrel's own body fields `json_schema`, `regex`, `lark` and `grammar_string` (GBNF) pass
  through as settings, as every other extra field does.
An invalid schema or grammar is a 400 whose `param` names the field and whose message says
where it is wrong.
"""

from __future__ import annotations

import json
from typing import Any

from extensions.openai.errors import ApiError
from loader.errors import ConstraintError
from loader.values import check_settings_constraint

# What each constraint setting is called in the request, for the 400's `param`.
_PARAMS = {"response_format": "response_format", "tools": "tools"}
_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def response_format_settings(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """Settings for `response_format` ({} for text or none)."""
    if response_format is None:
        return {}
    if not isinstance(response_format, dict):
        raise ApiError(400, "response_format must be an object", param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        where = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ApiError(400, f"{where}.schema must be a JSON schema object", param=where)
        return {"json_schema": schema, "_constraint_param": f"{where}.schema"}
    raise ApiError(
        400,
        f"response_format type {str(kind)[:100]!r} is not supported "
        "(text, json_object, json_schema)",
        param="response_format.type",
    )


def tool_settings(tools: list[dict[str, Any]] | None, tool_choice: Any) -> dict[str, Any]:
    """Settings that make the reply a valid call where the request asks for one ({} when
    the model is free, as without strict tools and with tool_choice "auto")."""
    if not tools:
        return {}
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            message = f"tool_choice names {str(name)[:64]!r}, not a declared tool"
            raise ApiError(400, message, param="tool_choice")
        return {"json_schema": _calls_schema(chosen), "_constraint_param": "tools"}
    if tool_choice == "required":
        return {"json_schema": _calls_schema(tools), "_constraint_param": "tools"}
    strict = [t for t in tools if t["function"].get("strict") is True]
    if not strict:
        return {}
    # "auto": a call to a strict tool, or text that cannot be read as a call.
    plain = " & ".join(
        ["/[^{\\[<\\s][\\s\\S]*/"]
        + [f"~/[\\s\\S]*{_escape(marker)}[\\s\\S]*/" for marker in _MARKERS]
    )
    lark = f"start: call | TEXT\ncall: %json {json.dumps(_calls_schema(strict))}\nTEXT: {plain}\n"
    return {"lark": lark, "_constraint_param": "tools"}


def _calls_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _escape(text: str) -> str:
    # (not "<" or ">": escaped they are word boundaries to llguidance's regexes)
    return "".join(f"\\{c}" if c in "[]|().*+?{}^$\\" else c for c in text)


def check_constraint_settings(state: dict[str, Any]) -> None:
    """A 400 naming the request field when the state's schema or grammar is wrong; takes
    the `_constraint_param` marker out of the state."""
    param = state.pop("_constraint_param", None)
    try:
        check_settings_constraint(state)
    except ConstraintError as error:
        raise ApiError(400, str(error), param=param or error.param) from None
