"""Bad input as a new user would give it: each gives one clear error naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import loader
from engine.config import ConfigError
from engine.engine import ContextLengthError
from engine.weights import WeightError
from helpers.model_factory import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path: Path):
    with pytest.raises(loader.LoaderError, match="not found: .*nowhere"):
        loader.load(tmp_path / "nowhere")


def test_missing_config_key(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    _edit_config(path, num_hidden_layers=None)
    with pytest.raises(ConfigError, match="'num_hidden_layers' is missing") as e:
        loader.load(path, "kestrel", device="cpu")
    assert "config.json" in str(e.value)


def test_bad_config_value(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    _edit_config(path, hidden_size="64")
    with pytest.raises(ConfigError, match="'hidden_size' must be a positive integer, got '64'"):
        loader.load(path, "kestrel", device="cpu")


def test_truncated_safetensors(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(WeightError, match="model.safetensors is truncated: tensor '.*'"):
        loader.load(path, "kestrel", device="cpu")


def test_not_a_safetensors_file(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(WeightError, match="not a safetensors file"):
        loader.load(path, "kestrel", device="cpu")


def test_tensor_with_wrong_shape(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = torch.zeros(10, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightError, match=rf"'{name}' .* shape \[10, 64\], .* expects \[160, 64\]"):
        loader.load(path, "kestrel", device="cpu")


def test_missing_tensor(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightError, match="'model.layers.0.self_attn.k_proj.weight' not found"):
        loader.load(path, "kestrel", device="cpu")


def test_unknown_architecture(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    _edit_config(path, architectures=["FancyNewForCausalLM"])
    with pytest.raises(
        ValueError, match="'FancyNewForCausalLM' is not supported.*LlamaForCausalLM"
    ):
        loader.load(path, "kestrel", device="cpu")


def test_pickle_checkpoint_refused(tiny: Path, tmp_path: Path):
    path = _copy(tiny, tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(WeightError, match="pytorch_model.bin: pickle checkpoints are not loaded"):
        loader.load(path, "kestrel", device="cpu")


def test_prompt_longer_than_context(tiny: Path):
    m = loader.load(tiny, "kestrel", device="cpu", max_seq_len=32)
    with pytest.raises(ContextLengthError, match="40 tokens.*context holds 32"):
        m.generate(list(range(3, 43)), {"max_new_tokens": 4})
    with pytest.raises(ContextLengthError, match="40 tokens.*context holds 32"):
        m.logits(list(range(3, 43)))
    # the engine is still usable after the error, and its cache pages were returned
    assert len(m.generate(list(range(3, 13)), {"max_new_tokens": 4, "temperature": 0})) >= 0
    assert m.engine.cache.free_pages == m.engine.cache.num_pages


def test_unknown_loader_and_options(tiny: Path):
    with pytest.raises(loader.LoaderError, match="unknown loader 'nope'"):
        loader.load(tiny, "nope")
    with pytest.raises(loader.LoaderError, match="unknown option.*colour"):
        loader.load(tiny, "kestrel", device="cpu", colour="blue")
    with pytest.raises(ValueError, match="cache_type 'q3'.*available: fp16, fp8, q8, q6, q4"):
        loader.load(tiny, "kestrel", device="cpu", cache_type="q3")


def test_sharded_checkpoint_loads(tiny: Path, tmp_path: Path):
    """A sharded checkpoint (index json) gives the same logits as the single file."""
    path = _copy(tiny, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k].to(torch.bfloat16) for k in keys}, path / fname)
        weight_map.update({k: fname for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = list(range(3, 30))
    a = loader.load(tiny, "kestrel", device="cpu", dtype="bfloat16").logits(ids)
    b = loader.load(path, "kestrel", device="cpu", dtype="bfloat16").logits(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
