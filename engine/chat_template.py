"""Chat templates: find a model's Jinja template and render it the way transformers does.

Contract: `render_chat_template(source, messages, ...)` returns the same string as
`transformers` `apply_chat_template(..., tokenize=False)` for the same template, messages and
special tokens: an `ImmutableSandboxedEnvironment` (bounded in time and output size,
engine/template_limits.py) with `trim_blocks`/`lstrip_blocks`, the
`loopcontrols` extension, a pass-through `{% generation %}` tag, transformers' `tojson` filter
(no HTML escaping, `ensure_ascii=False`), and the globals `raise_exception`, `strftime_now`,
`dict` and a `namespace` that rejects underscore-prefixed names. The template sees `messages`,
`tools`, `documents`, `add_generation_prompt`, the special-token strings and any extra keyword
arguments. Messages and tools are rebuilt as plain JSON-like data first, because templates are
untrusted code from the Hub and rich objects carry methods the sandbox cannot vet. Tools must be
JSON-schema dicts (transformers also accepts Python functions; Kestrel does not import it).

`load_chat_template(model_dir, tokenizer_config)` finds the source with transformers' priority:
`chat_template.jinja` (plus `additional_chat_templates/*.jinja`), then tokenizer_config's
`chat_template` (a string, or a list of {name, template}), then a processor-style
`chat_template.json`. Several templates come back as a dict keyed by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from engine.errors import KestrelError
from engine.template_limits import BoundedSandbox, bounded_render

ChatTemplate = str | dict[str, str]


class ChatTemplateError(KestrelError, ValueError):
    """The model has no usable chat template, or rendering it failed."""


def load_chat_template(
    model_dir: str | Path, tokenizer_config: Mapping[str, Any]
) -> ChatTemplate | None:
    """Return the model's chat template source(s), or None if it has none."""
    model_dir = Path(model_dir)
    templates: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates

    configured = tokenizer_config.get("chat_template")
    json_file = model_dir / "chat_template.json"
    if configured is None and json_file.is_file():
        try:
            configured = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ChatTemplateError(f"{json_file}: not a JSON object with 'chat_template'") from exc
    if isinstance(configured, list):
        return {entry["name"]: entry["template"] for entry in configured}
    if configured is not None and not isinstance(configured, str | dict):
        raise ChatTemplateError(f"{model_dir}: chat_template must be a string or a list")
    return configured


def select_template(template: ChatTemplate | None, *, tools: Any = None) -> str:
    """Pick the template source to render: "tool_use" when tools are given, else "default"."""
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template (none in tokenizer_config.json, chat_template.jinja "
            "or chat_template.json); format the prompt yourself or add a template"
        )
    if isinstance(template, str):
        return template
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ChatTemplateError(
        f"the model has several chat templates and none is named 'default': {sorted(template)}"
    )


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` through the template `source`; raises ChatTemplateError on failure."""
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise ChatTemplateError("tools must be JSON-schema dicts")
    chat = [_with_reasoning_aliases(message) for message in _plain(messages)]
    for message in chat:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {message!r}")
    # Explicit keyword arguments override special tokens of the same name, as in transformers.
    variables = {**(special_tokens or {}), **_plain(extra)}
    template = _compile(source)
    try:
        return bounded_render(
            template,
            dict(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            ),
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except Exception as exc:
        # The template is code from the Hub: whatever it raises (a TypeError from tojson of
        # an undefined value the messages did not supply, a macro recursing forever, a
        # MemoryError) is a problem of these messages with this template, not a crash.
        hint = ""
        if isinstance(exc, TypeError) and "Undefined" in str(exc):
            hint = " (a field the template reads is missing, e.g. a tool call's 'arguments')"
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}{hint}") from exc


def _with_reasoning_aliases(message: Any) -> Any:
    # transformers fills `reasoning_content` (what templates read) and `thinking` (gpt-oss) from
    # whichever reasoning field the caller used; matching it keeps the rendered prompts identical.
    if not isinstance(message, dict):
        return message
    fields = ("reasoning_content", "thinking", "reasoning")
    reasoning = next((message[k] for k in fields if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    # Templates come from the Hub: they may only ever see inert JSON-like data.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return _plain(value.item())  # np.bool_(False) must not become a truthy placeholder
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    # Training templates mark assistant spans with {% generation %}; rendering only needs the body.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    # Underscore names would reach CPython internals through attribute access.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _TemplateDict:
    # The builtin type itself would hand templates its attributes; this exposes only construction.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc
