"""Structured output through the API with the real `openai` client and SmolLM2-135M.

200 generations under 10 tool-use JSON schemas (tests/data/constrained/tool_schemas.json:
nested objects, enums, arrays, required fields, bounded numbers) parse and validate,
greedy and sampled; json_object gives a JSON object; GBNF grammars through
`grammar_string` give text the grammar accepts; strict tools give calls whose arguments
validate; an invalid schema is a 400 naming the field (tests/api/test_bad_inputs_api.py has
more of those).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import openai
import pytest

from extensions.openai import ApiServer, run_api_server
from loader.default_model import (
    DEFAULT_MODEL,
    default_model_path,
    ensure_packaged_model,
    is_converted,
)
from loader.manager import ModelManager
from serving import shared

DATA = Path(__file__).parents[1] / "data" / "constrained"
SCHEMAS = json.loads((DATA / "tool_schemas.json").read_text())
# SmolLM2's own template with a place for tools (its shipped one has none).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou can call these tools: {{ tools | tojson }}"
    "<|im_end|>\n{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GRAMMARS = ["arithmetic", "json", "list", "chess"]
ASKS = [
    "Fill in the arguments for {name}.",
    "Call {name} for me, please.",
    "I need {name}. Use realistic values.",
    "Example arguments for {name}?",
    "Run {name} now.",
    "Make up a request for {name}.",
    "Use the {name} tool.",
    "What would you pass to {name}?",
    "{name}, quickly.",
    "Please do {name} for my family.",
]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the model runs: the CPU with the default model's float32 import (every
    machine), or CUDA with its EXL2 form in float16 (what the web UI runs; GPU machines
    that have it in models/, since they may have no network to fetch it)."""

    device: str
    dtype: str
    source: Path


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "cpu":
        return Target("cpu", "float32", ensure_packaged_model(DEFAULT_MODEL, None, quiet=True))
    exl2 = default_model_path()
    if not is_converted(exl2):
        pytest.skip(f"needs the default model's EXL2 form in {exl2} (no network on GPU hosts)")
    return Target("cuda", "float16", exl2)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, target: Target) -> Iterator[openai.OpenAI]:
    models = tmp_path_factory.mktemp("structured")
    for name, template in (("smol", None), ("smol-tools", TOOLS_TEMPLATE)):
        model_dir = models / name
        model_dir.mkdir()
        for item in target.source.iterdir():
            if item.suffix == ".safetensors":
                _link_or_copy(item, model_dir / item.name)  # the loader refuses symlinks out
            elif item.is_file():
                shutil.copy(item, model_dir / item.name)
        if template is not None:
            (model_dir / "chat_template.jinja").write_text(template)
    (models / "loras").mkdir()
    manager = ModelManager(models, models / "loras")
    # Room for 32 jobs at once (the default cache holds one max_seq_len): the test's 200
    # generations run as a few large batches, not five jobs at a time.
    manager.load(
        "smol",
        "kestrel",
        device=target.device,
        dtype=target.dtype,
        max_seq_len=1024,
        cache_tokens=32 * 256,
    )
    previous, shared.manager = shared.manager, manager
    server: ApiServer = run_api_server("127.0.0.1", 0, manager=manager)
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()
        shared.manager = previous
        manager.unload()


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy(source, target)


def _schema_format(name: str) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


def test_200_generations_under_10_tool_schemas_validate(client: openai.OpenAI) -> None:
    def greedy(name: str, ask: str) -> list[tuple[str, str, str]]:
        reply = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": ask.format(name=name)}],
            response_format=_schema_format(name),
            temperature=0,
            max_tokens=120,
        )
        return [(name, c.message.content, c.finish_reason) for c in reply.choices]

    def sampled(name: str) -> list[tuple[str, str, str]]:
        reply = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": ASKS[0].format(name=name)}],
            response_format=_schema_format(name),
            temperature=0.9,
            seed=11,
            n=10,
            max_tokens=120,
        )
        return [(name, c.message.content, c.finish_reason) for c in reply.choices]

    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(sampled, name) for name in SCHEMAS]
        futures += [pool.submit(greedy, name, ask) for name in SCHEMAS for ask in ASKS]
        results = [item for future in futures for item in future.result()]
    assert len(results) == 200
    for name, content, reason in results:
        assert reason == "stop", (name, content)
        jsonschema.validate(json.loads(content), SCHEMAS[name])
    # Sampling varies what is written, within the schema.
    assert len({content for _, content, _ in results[:10]}) > 1


@pytest.fixture(scope="module")
def short_replies(client: openai.OpenAI) -> dict[str, Any]:
    """json_object and the four GBNF grammars, asked at once: one batch, where one request
    after another took five times as long on a CPU."""

    def json_object() -> Any:
        return client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Describe a dog as JSON."}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=60,
        )

    def gbnf(grammar: str) -> Any:
        return client.completions.create(
            model="smol",
            prompt=f"Here is an example of {grammar}:\n",
            max_tokens=32,
            temperature=0.7,
            seed=5,
            n=2,
            extra_body={"grammar_string": (DATA / f"{grammar}.gbnf").read_text()},
        )

    with ThreadPoolExecutor(len(GRAMMARS) + 1) as pool:
        futures = {"json_object": pool.submit(json_object)}
        futures.update({name: pool.submit(gbnf, name) for name in GRAMMARS})
        return {name: future.result() for name, future in futures.items()}


def test_json_object(short_replies: dict[str, Any]) -> None:
    choice = short_replies["json_object"].choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an object can go on for ever: what there is must be its beginning
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_gbnf_grammar_string(short_replies: dict[str, Any], target: Target, grammar: str) -> None:
    text = (DATA / f"{grammar}.gbnf").read_text()
    reply = short_replies[grammar]
    assert len(reply.choices) == 2
    ll_tok = llguidance.LLTokenizer((target.source / "tokenizer.json").read_text())
    for choice in reply.choices:
        matcher = llguidance.LLMatcher(ll_tok, llguidance.grammar_from("gbnf", text), log_level=0)
        ids = ll_tok.tokenize_str(choice.text)
        assert matcher.consume_tokens(ids), (choice.text, matcher.get_error())
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert matcher.is_accepting(), choice.text


def test_strict_tools_give_calls_whose_arguments_validate(
    client: openai.OpenAI, target: Target
) -> None:
    on = {"device": target.device, "dtype": target.dtype, "max_seq_len": 1024}
    # Room for the five requests at once (their prompts carry the tools).
    shared.manager.load("smol-tools", "kestrel", cache_tokens=4096, **on)
    try:
        tools = [
            {"type": "function", "function": {"name": name, "parameters": SCHEMAS[name],
                                              "strict": True}}
            for name in ("get_current_weather", "book_flight")
        ]  # fmt: skip
        asks = ["What is the weather in Oslo?", "Fly me from LAX to JFK."]
        named_choice = {"type": "function", "function": {"name": "book_flight"}}
        cases = [(a, c) for a in asks for c in ("required", "auto")] + [(asks[0], named_choice)]

        def ask_with(ask: str, choice: Any) -> Any:
            return client.chat.completions.create(
                model="smol-tools",
                messages=[{"role": "user", "content": ask}],
                tools=tools,
                tool_choice=choice,
                temperature=0,
                max_tokens=100,
            )

        # All at once: one batch (greedy replies do not depend on their batch).
        with ThreadPoolExecutor(len(cases)) as pool:
            replies = list(pool.map(lambda case: ask_with(*case), cases))
        for (_, choice), reply in zip(cases[:-1], replies[:-1], strict=True):
            message = reply.choices[0].message
            if choice == "required":
                assert reply.choices[0].finish_reason == "tool_calls", message
            for call in message.tool_calls or []:
                schema = SCHEMAS[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), schema)
            if not message.tool_calls:  # "auto": text that does not look like a call
                assert message.content and message.content[0] not in "{[< \n"
        (call,) = replies[-1].choices[0].message.tool_calls
        assert call.function.name == "book_flight"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["book_flight"])
    finally:
        shared.manager.load("smol", "kestrel", **on)


def test_an_invalid_schema_is_a_400_saying_where(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": "five"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
    error = caught.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert "minimum" in error["message"], error
