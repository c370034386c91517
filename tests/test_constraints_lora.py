"""A JSON schema together with a LoRA adapter (issue 32): a tiny random Llama with a real
peft adapter (random non-zero A and B, saved by peft), on the CPU. In one batch, a
constrained job with the adapter, one without it and a free job with it each get the tokens
they get alone; the constrained outputs parse and validate, and the adapter changes them."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from peft import LoraConfig, get_peft_model

import loader

from model_factory import make_tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
PROMPT = [5, 17, 99, 203, 11, 42, 300, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-constrained")
    make_tiny_llama(root / "llama")
    base = AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32)
    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(root / "adapter")
    m = loader.load(root / "llama", "kestrel", device="cpu", dtype="float32", max_seq_len=256)
    assert m.load_lora(root / "adapter", name="A") == "A"
    yield m
    m.unload()


def _tokens(chunks) -> tuple[list[int], str, str | None]:
    ids = [t for c in chunks for t in c.token_ids]
    return ids, "".join(c.text for c in chunks), chunks[-1].finish_reason


def test_a_schema_with_a_lora_adapter_in_a_mixed_batch(model) -> None:
    greedy = {"max_new_tokens": 160, "temperature": 0}
    jobs = [
        {**greedy, "json_schema": SCHEMA, "loras": {"A": 1.0}},
        {**greedy, "json_schema": SCHEMA, "loras": {}},
        {**greedy, "max_new_tokens": 24, "ban_eos_token": True, "loras": {"A": 1.0}},
    ]
    alone = [_tokens(list(model.stream(PROMPT, settings))) for settings in jobs]
    for _, text, reason in alone[:2]:
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert alone[0][0] != alone[1][0], "the adapter changed nothing: the test proves nothing"
    chunks: dict[int, list] = {i: [] for i in range(len(jobs))}
    for chunk in model.stream_many([PROMPT] * len(jobs), jobs):
        chunks[chunk.job_id].append(chunk)
    batched = [_tokens(chunks[i]) for i in range(len(jobs))]
    assert batched == alone
