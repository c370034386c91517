"""Embeddings: the loaders' pooled final hidden states against transformers', and
/v1/embeddings with the real `openai` client (float and base64 encodings)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

import loader
from extensions.openai import ApiServer, run_api_server
from helpers.model_factory import make_tiny_llama, randomize_weights, write_tokenizer
from loader.embeddings import EmbeddingError, default_pooling
from loader.manager import ModelManager
from serving import shared

TEXTS = ["The kestrel hovers over the field.", "A small falcon.", "Tensor cores"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("embed")
    hf = make_tiny_llama(root / "models" / "tiny")
    (root / "loras").mkdir()
    return root, hf


def _reference(hf: torch.nn.Module, ids: list[int], pooling: str, dims: int | None = None):
    """transformers' final hidden states (after the final norm), pooled, normalised."""
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector[:dims], dim=0)


@pytest.fixture(scope="module")
def served(tiny) -> Iterator[tuple[openai.OpenAI, loader.LoadedModel]]:
    root, _ = tiny
    manager = ModelManager(root / "models", root / "loras")
    manager.load("tiny", "kestrel", device="cpu", dtype="float32")
    previous, shared.manager = shared.manager, manager
    server: ApiServer = run_api_server("127.0.0.1", 0, manager=manager)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        yield client, manager.current()
    finally:
        server.stop()
        shared.manager = previous
        manager.unload()


@pytest.mark.parametrize("loader_name", ["kestrel", "transformers"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_are_transformers_hidden_states_pooled(tiny, loader_name, pooling):
    root, hf = tiny
    # Chunks of 8 tokens: the kestrel loader's states of later chunks read the paged cache.
    extra = {"prefill_chunk": 8} if loader_name == "kestrel" else {}
    m = loader.load(root / "models" / "tiny", loader_name, device="cpu", dtype="float32", **extra)
    try:
        ids = m.encode_for_embedding(TEXTS[0])
        assert len(ids) > 8
        got = m.embed(ids, pooling)
        torch.testing.assert_close(got, _reference(hf, ids, pooling), rtol=1e-4, atol=1e-5)
        assert abs(float(got.norm()) - 1.0) < 1e-5
        short = m.embed(ids, pooling, dimensions=16)
        torch.testing.assert_close(short, _reference(hf, ids, pooling, 16), rtol=1e-4, atol=1e-5)
    finally:
        m.unload()


def test_the_models_pooling_config_decides_the_default(tmp_path: Path):
    assert default_pooling(tmp_path) == "mean"  # no sentence-transformers config
    config = tmp_path / "1_Pooling" / "config.json"
    config.parent.mkdir()
    modes = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
    config.write_text(json.dumps(modes))
    assert default_pooling(tmp_path) == "last"
    config.write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(EmbeddingError, match="pooling_mode_cls_token"):
        default_pooling(tmp_path)
    config.write_text("{not json")
    with pytest.raises(EmbeddingError, match="not readable JSON"):
        default_pooling(tmp_path)


def test_v1_embeddings_with_the_openai_client(served, tiny):
    client, model = served
    _, hf = tiny
    # Left out, encoding_format is base64 on the wire and the client decodes it; asked for
    # explicitly, base64 comes back as the string (little-endian float32).
    for extra in ({}, {"encoding_format": "float"}, {"encoding_format": "base64"}):
        reply = client.embeddings.create(model="tiny", input=TEXTS, **extra)
        assert [d.index for d in reply.data] == [0, 1, 2]
        for text, item in zip(TEXTS, reply.data, strict=True):
            vector = item.embedding
            if isinstance(vector, str):
                vector = np.frombuffer(base64.b64decode(vector), dtype="<f4").copy()
            expected = _reference(hf, model.encode_for_embedding(text), "mean")
            torch.testing.assert_close(torch.tensor(vector), expected, rtol=1e-4, atol=1e-5)
        assert reply.usage.prompt_tokens == sum(len(model.encode_for_embedding(t)) for t in TEXTS)
    ids = model.encode_for_embedding(TEXTS[1])
    reply = client.embeddings.create(
        model="tiny", input=[ids], dimensions=8, extra_body={"pooling": "last"}
    )
    (item,) = reply.data
    torch.testing.assert_close(
        torch.tensor(item.embedding), _reference(hf, ids, "last", 8), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["ok", ""]}, "input", "input[1] is an empty string"),
        ({"input": [[1, 2, 99999]]}, "input", "outside"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "int8"),
        ({"input": "x", "pooling": "cls"}, "pooling", "cls"),
        ({"input": "x", "dimensions": 0}, "dimensions", ">= 1"),
        ({"input": "x", "dimensions": 65}, "dimensions", "1..64"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ],
)
def test_bad_embedding_requests_are_a_400_naming_the_field(served, body, param, words):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/embeddings", body={"model": "tiny", **body}, cast_to=object)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error


def safe_names(path: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return names


def _qwen3_embedding_model(path: Path):
    """A tiny model shipped as Qwen3-Embedding ships: the backbone alone (tensor names
    without "model.", no lm_head, tied), a tokenizer whose post-processor closes every
    text with a special token, and a sentence-transformers config naming last-token
    pooling. Returns transformers' Qwen3Model of it."""
    from tokenizers import Tokenizer, processors
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(3)
    model = Qwen3Model(config)
    randomize_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    closing = tok.token_to_id("<|im_end|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|im_end|>", special_tokens=[("<|im_end|>", closing)]
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return model.float().eval(), closing


def test_a_qwen3_embedding_style_checkpoint_loads_and_embeds_like_transformers(tmp_path: Path):
    path = tmp_path / "qwen3-embedding"
    hf, closing = _qwen3_embedding_model(path)
    assert not any(n.startswith("model.") for n in safe_names(path))
    m = loader.load(path, "kestrel", device="cpu", dtype="float32")
    try:
        ids = m.encode_for_embedding(TEXTS[0])
        assert ids[-1] == closing and m.encode(TEXTS[0])[-1] != closing
        with torch.no_grad():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
        expected = torch.nn.functional.normalize(hidden[-1], dim=0)
        # The pooling config names last-token pooling: the default.
        torch.testing.assert_close(m.embed(ids), expected, rtol=1e-4, atol=1e-5)
    finally:
        m.unload()


def test_embeddings_apply_the_default_lora_as_peft_does(tiny, tmp_path: Path):
    """Under a default adapter selection (set_loras), hidden states are the peft model's."""
    from helpers.lora import ALL, hf_model, make_adapter

    root, _ = tiny
    path = root / "models" / "tiny"
    peft_model = make_adapter(
        hf_model(path), tmp_path / "A", 1, r=4, lora_alpha=8, target_modules=ALL
    )
    m = loader.load(path, "kestrel", device="cpu", dtype="float32", prefill_chunk=8)
    try:
        m.load_lora(tmp_path / "A", "A")
        ids = m.encode_for_embedding(TEXTS[0])
        plain = m.embed(ids)
        m.set_loras({"A": 1.0})
        with torch.no_grad():
            out = peft_model(torch.tensor([ids]), output_hidden_states=True)
        expected = torch.nn.functional.normalize(out.hidden_states[-1][0].mean(0), dim=0)
        got = m.embed(ids)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got, plain, atol=1e-3)  # the adapter changed something
    finally:
        m.unload()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_embeddings_on_the_gpu_match_the_cpu(tiny):
    """The GPU path (fused norm kernels, paged attention over earlier 8-token chunks) gives
    the CPU's vectors up to fp16 rounding."""
    root, _ = tiny
    path = root / "models" / "tiny"
    vectors = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float16")):
        m = loader.load(path, "kestrel", device=device, dtype=dtype, prefill_chunk=8)
        try:
            ids = m.encode_for_embedding(" ".join(TEXTS))
            assert len(ids) > 16
            vectors[device] = [m.embed(ids, pooling) for pooling in ("mean", "last")]
        finally:
            m.unload()
    for got, want in zip(vectors["cuda"], vectors["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-3)


def test_short_inputs_share_forwards_and_give_the_same_states(tiny, monkeypatch):
    root, _ = tiny
    m = loader.load(
        root / "models" / "tiny",
        "kestrel",
        device="cpu",
        dtype="float32",
        page_size=16,
        cache_tokens=512,
        prefill_chunk=32,  # the step's token budget (with max_batch <= 32)
        max_batch=8,
    )
    try:
        engine = m.engine
        inputs = [m.encode_for_embedding(t) for t in [*TEXTS, " ".join(TEXTS * 3), "Hi"]]
        assert sum(map(len, inputs[:3])) <= 32 < len(inputs[3])
        alone = [m.hidden_states(ids) for ids in inputs]
        calls = []
        forward = engine.model.hidden_states
        monkeypatch.setattr(
            engine.model, "hidden_states", lambda b, c: calls.append(b) or forward(b, c)
        )
        together = m.hidden_states_many(inputs)
        for got, want in zip(together, alone, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # Packed in order into full forwards of 32 tokens (the long one split over them),
        # the last one holding what is left.
        tokens = [len(batch.token_ids) for batch in calls]
        assert tokens[:-1] == [32] * (len(tokens) - 1) and sum(tokens) == sum(map(len, inputs))
        assert engine.cache.free_pages == engine.cache.num_pages  # nothing stays cached
    finally:
        m.unload()


def test_embeddings_wait_for_pages_and_give_them_back(tiny):
    # A cache of 4 pages of 8 tokens: 10 inputs of 9..18 tokens (2-3 pages each) cannot
    # all be in it at once; they wait their turn and every page comes back.
    root, _ = tiny
    m = loader.load(
        root / "models" / "tiny", "kestrel", device="cpu", dtype="float32", page_size=8,
        cache_tokens=32, prefill_chunk=64, max_batch=8,
    )  # fmt: skip
    try:
        inputs = [list(range(5, 14 + n)) for n in range(10)]
        alone = [m.hidden_states(ids) for ids in inputs]
        together = m.hidden_states_many(inputs)
        for got, want in zip(together, alone, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        cache = m.engine.cache
        assert cache.free_pages == cache.num_pages
    finally:
        m.unload()
