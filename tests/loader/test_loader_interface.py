"""What front ends read of a loaded model through the loader interface (loader/base.py), the
same for every loader: vocabulary size, context length, token bytes, the chat template and
the logits' device. The API and the UI read these instead of reaching into `backend`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import loader
from helpers.model_factory import CHAT_TEMPLATE, make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    make_tiny_llama(path)
    return path


@pytest.mark.parametrize("name", ["kestrel", "transformers"])
def test_limits_and_tokens_through_the_interface(tiny_dir: Path, name: str) -> None:
    model = loader.load(tiny_dir, name, device="cpu", dtype="float32", max_seq_len=256)
    try:
        ids = model.encode("Once upon a time", add_bos=False)
        assert model.vocab_size == model.logits(ids).shape[-1]
        assert all(0 <= i < model.vocab_size for i in ids)
        assert model.context_length == 256 == model.info()["context"]
        longest = max(len(model.tokenizer.token_bytes(i)) for i in range(model.vocab_size))
        assert model.max_token_bytes == max(1, longest)
        assert model.logits_device == torch.device("cpu")
        # decode keeps or drops special tokens on request (TGW's skip_special_tokens)
        bos = model.tokenizer.bos_token_id
        assert bos is not None
        assert model.decode([bos, *ids], skip_special=True) == model.decode(ids)
        assert model.decode([bos, *ids], skip_special=False) != model.decode(ids)
        # the test model's tokenizer_config.json carries the template the chat flow renders
        assert model.chat_template == CHAT_TEMPLATE
        messages = [{"role": "user", "content": "Hi"}]
        assert "Hi" in model.apply_chat_template(messages, add_generation_prompt=True)
    finally:
        model.unload()


def test_structured_output_on_the_transformers_loader_is_refused_not_ignored(
    tiny_dir: Path,
) -> None:
    """It has no token masks: output that only looks constrained would be worse than an
    error; the kestrel loader takes the same request."""
    settings = {"max_new_tokens": 4, "temperature": 0, "regex": "[0-9]+"}
    model = loader.load(tiny_dir, "transformers", device="cpu", dtype="float32")
    try:
        with pytest.raises(loader.UnsupportedFeatureError, match="needs the kestrel loader"):
            list(model.stream("Count:", settings))
        with pytest.raises(loader.UnsupportedFeatureError, match="needs the kestrel loader"):
            list(model.stream_many(["a", "b"], settings))
        plain = list(model.stream("Count:", {"max_new_tokens": 2, "temperature": 0}))
        assert plain[-1].finish_reason == "length"
    finally:
        model.unload()
    model = loader.load(tiny_dir, "kestrel", device="cpu", dtype="float32")
    try:
        text = "".join(chunk.text for chunk in model.stream("Count:", settings))
        assert text.isdigit() and text, text
    finally:
        model.unload()
