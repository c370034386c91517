"""Function calling through /v1/chat/completions with the real `openai` client.

The model is a real LlamaForCausalLM whose weights script its greedy reply: a Hermes-style
`<tool_call>` block (tests/helpers/model_factory.py, make_scripted_llama). Its chat template writes
the tools and earlier calls into the prompt as a tool-use template does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import loader
from extensions.openai import ApiServer, run_api_server
from extensions.openai.errors import ApiError
from extensions.openai.tools import (
    ToolCallStream,
    check_template_takes_tools,
    parse_tool_calls,
    template_messages,
)
from helpers.model_factory import make_scripted_llama
from loader.manager import ModelManager
from serving import shared

TOOL_TEMPLATE = (
    "{%- if tools %}tools: {{ tools | tojson }} {% endif -%}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}"
    "{%- if m.tool_calls %} calls: {{ m.tool_calls | tojson }}{% endif %} {% endfor -%}"
    "{%- if add_generation_prompt %}assistant:{% endif %}"
)
PLAIN_TEMPLATE = (
    "{%- for m in messages %}{{ m.role }}: {{ m.content }} {% endfor -%}"
    "{%- if add_generation_prompt %}assistant:{% endif %}"
)
SCRIPT = [
    "assistant:", "<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":',
    '"Paris"}}', "</tool_call>",
]  # fmt: skip
REPLY = " ".join(SCRIPT[1:])
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tools")
    make_scripted_llama(root / "models" / "caller", SCRIPT, TOOL_TEMPLATE)
    make_scripted_llama(root / "models" / "plain", SCRIPT, PLAIN_TEMPLATE)
    (root / "loras").mkdir()
    return root


@pytest.fixture(scope="module")
def client(models: Path) -> Iterator[openai.OpenAI]:
    manager = ModelManager(models / "models", models / "loras")
    manager.load("caller", "kestrel", device="cpu", dtype="float32", page_size=16)
    previous, shared.manager = shared.manager, manager
    server: ApiServer = run_api_server("127.0.0.1", 0, manager=manager)
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()
        shared.manager = previous
        manager.unload()


def _chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model="caller", messages=ASK, temperature=0, max_tokens=20, **extra
    )


def test_a_written_call_comes_back_as_tool_calls(client: openai.OpenAI):
    choice = _chat(client, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_call_arrives_as_tool_call_deltas(client: openai.OpenAI):
    content, calls, reasons = "", [], []
    for chunk in _chat(client, tools=[WEATHER], stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert "<tool_call>" not in content and not content.strip()
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert reasons == ["tool_calls"]


def test_without_tools_or_with_tool_choice_none_the_reply_is_text(client: openai.OpenAI):
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        choice = _chat(client, **extra).choices[0]
        assert choice.message.content.strip() == REPLY
        assert not choice.message.tool_calls and choice.finish_reason == "stop"


def test_an_earlier_call_and_its_result_go_back_into_the_prompt(client: openai.OpenAI):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    reply = client.chat.completions.create(
        model="caller", messages=history, tools=[WEATHER], temperature=0, max_tokens=20
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    # The template gets the arguments as an object, as templates expect.
    model = shared.manager.current()
    messages = template_messages([dict(m) for m in history])
    prompt = model.apply_chat_template(messages, add_generation_prompt=True, tools=[WEATHER])
    assert '"arguments": {"city": "Paris"}' in prompt and "tool: 18 C, sunny" in prompt


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "must be 'function'"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name",
         "1-64 letters"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "declared twice"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "not supported"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "not a declared tool"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, **extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"]


def test_a_template_without_tools_is_refused(models: Path):
    model = loader.load(models / "models" / "plain", "kestrel", device="cpu", dtype="float32")
    try:
        with pytest.raises(ApiError, match="chat template does not take tools") as caught:
            check_template_takes_tools(model, ASK, [WEATHER])
        assert caught.value.status == 400
    finally:
        model.unload()


NAMES = {"get_weather", "add"}
CALLS = {
    "hermes": (
        'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "Checking.",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "",
        [("add", {"a": 1, "b": 2})],
    ),
    "llama31": (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "",
        [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})],
    ),
    "bare_json_in_a_fence": (
        '```json\n{"name": "add", "arguments": {"a": 1}}\n```',
        "",
        [("add", {"a": 1})],
    ),
    "undeclared_tool": ('{"name": "rm", "arguments": {}}', '{"name": "rm", "arguments": {}}', []),
    "cut_off": ('<tool_call>{"name": "add", "argu', '<tool_call>{"name": "add", "argu', []),
    "plain_text": ("The weather is fine.", "The weather is fine.", []),
    "json_that_is_no_call": ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_call_formats_parse_whole_and_streamed(case: str):
    text, content, expected = CALLS[case]
    got_content, calls = parse_tool_calls(text, NAMES)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert (got_content, got) == (content, expected)
    # Streamed in 3-character pieces: no call text is ever sent, and the text around the
    # calls is (up to white space) what the whole reply gives.
    stream, sent = ToolCallStream(NAMES), ""
    for i in range(0, len(text), 3):
        sent += stream.feed(text[i : i + 3])
    rest, streamed_calls = stream.finish()
    assert [c["function"]["name"] for c in streamed_calls] == [name for name, _ in expected]
    if expected:
        assert all(m not in sent + rest for m in ("<tool_call>", "[TOOL_CALLS]", '"name"'))
    assert (sent + rest).strip() == content
