"""The API's sampling when a request chooses none (issue 25): temperature 0.7 with min_p 0.1
(README, "OpenAI-compatible API"), not OpenAI's temperature 1 with nothing cut, which gave
word salad on the default model; a request that sets any sampler gets exactly that."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from engine.sampling_settings import SamplingSettings
from extensions.openai import ApiServer, run_api_server
from extensions.openai.params import build_state
from extensions.openai.schemas import ChatCompletionRequest
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from serving import shared

LOAD_OPTIONS = dict(device="cpu", dtype="float32", page_size=16, cache_tokens=1024)


def test_a_request_without_sampling_fields_gets_the_documented_defaults() -> None:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    settings = SamplingSettings.from_any(build_state(body))
    assert (settings.temperature, settings.min_p, settings.top_p) == (0.7, 0.1, 1.0)
    assert settings.repetition_penalty_range == 1024  # TGW's default


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 1.0}, {"top_p": 0.5}, {"top_k": 3}, {"do_sample": False}],
)
def test_a_request_that_chooses_sampling_gets_only_what_it_chose(fields: dict) -> None:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **fields)
    state = build_state(body)
    settings = SamplingSettings.from_any(state)
    assert settings.min_p == 0.0
    assert "min_p" not in state
    for key, value in fields.items():
        assert getattr(settings, key) == value


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelManager]:
    root = tmp_path_factory.mktemp("defaults")
    make_tiny_llama(root / "models" / "tiny")
    manager = ModelManager(root / "models", root / "loras")
    manager.load("tiny", "kestrel", **LOAD_OPTIONS)
    previous, shared.manager = shared.manager, manager
    yield manager
    shared.manager = previous
    manager.unload()


@pytest.fixture(scope="module")
def server(manager: ModelManager) -> Iterator[ApiServer]:
    running = run_api_server("127.0.0.1", 0, manager=manager)
    yield running
    running.stop()


def test_the_server_samples_with_the_defaults(server: ApiServer, manager: ModelManager) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = manager.current()
    # No sampling field; a seed (not a sampler) makes the draw repeatable.
    out = client.completions.create(
        model="tiny", prompt="Kestrels", max_tokens=12, seed=7,
        extra_body={"ban_eos_token": True},
    )  # fmt: skip
    base = {"seed": 7, "max_new_tokens": 12, "ban_eos_token": True}
    expected = model.generate("Kestrels", {**base, "temperature": 0.7, "min_p": 0.1})
    assert out.choices[0].text == expected
    # The draw OpenAI's own defaults would give differs (what the server did before).
    assert expected != model.generate("Kestrels", {**base, "temperature": 1.0})
