"""Damaged GGUF files through `import_gguf`, `ModelManager.load` (a .gguf entry of the models
directory) and `convert()`: each is refused with `GGUFImportError` (a ConvertError from the
converter) naming the file and what is wrong, nothing is left behind, and a good GGUF still
imports and generates afterwards."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.gguf_import import GGUFImportError, import_gguf
from engine.quantizer import ConvertError, ConvertOptions, convert
from helpers.bad_inputs import GREEDY, PROMPT, cases
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager

pytest.importorskip("gguf")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from helpers.gguf import write_tiny_llama_gguf

    root = tmp_path_factory.mktemp("bad-gguf")
    make_tiny_llama(root / "hf", dtype=torch.float16, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    path = root / "tiny.gguf"
    write_tiny_llama_gguf(hf, root / "hf" / "tokenizer.json", path)
    return path


def _cut(fraction: float) -> Callable[[bytes], bytes]:
    return lambda data: data[: int(len(data) * fraction)]


def _u64_at(offset: int, value: int) -> Callable[[bytes], bytes]:
    return lambda data: data[:offset] + struct.pack("<Q", value) + data[offset + 8 :]


CORRUPT = r"unreadable GGUF file, truncated or corrupt"
GGUF_CASES = [
    ("empty", lambda d: b"", r"is not a GGUF file \(it starts with b''"),
    ("safetensors-renamed", lambda d: b"\x08\x00\x00\x00\x00\x00\x00\x00{}", r"not a GGUF file"),
    ("magic-only", lambda d: d[:4], CORRUPT),
    ("header-only", lambda d: d[:24], CORRUPT),
    ("truncated-at-10%", _cut(0.1), CORRUPT),
    ("truncated-at-50%", _cut(0.5), CORRUPT),
    ("truncated-last-100-bytes", lambda d: d[:-100], CORRUPT),
    ("version-99", lambda d: d[:4] + struct.pack("<I", 99) + d[8:], r"version 99"),
    ("tensor-count-2^60", _u64_at(8, 2**60), CORRUPT),
    ("metadata-count-2^60", _u64_at(16, 2**60), CORRUPT),
]


@cases("damage, match", GGUF_CASES)
def test_damaged_gguf_import(good_gguf, tmp_path, damage, match):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good_gguf.read_bytes()))
    out = tmp_path / "out"
    with pytest.raises(GGUFImportError, match=match) as caught:
        import_gguf(bad, out, progress=False)
    assert str(bad) in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"], "a partial import was left"


@cases("damage, match", GGUF_CASES[:1] + GGUF_CASES[5:6])
def test_damaged_gguf_through_the_model_manager_then_a_good_one(good_gguf, tmp_path, damage, match):
    models = tmp_path / "models"
    models.mkdir()
    (models / "bad.gguf").write_bytes(damage(good_gguf.read_bytes()))
    (models / "good.gguf").write_bytes(good_gguf.read_bytes())
    manager = ModelManager(models)
    with pytest.raises(GGUFImportError, match=match):
        manager.load("bad.gguf", device="cpu", max_seq_len=64)
    assert not manager.is_loaded()
    assert sorted(p.name for p in models.iterdir()) == ["bad.gguf", "good.gguf"]
    model = manager.load("good.gguf", device="cpu", max_seq_len=64)  # the process serves on
    assert model.generate(PROMPT, GREEDY)


def test_damaged_gguf_through_convert(good_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good_gguf.read_bytes()[:5000])
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=rf"{bad}: unreadable GGUF file"):
        convert(bad, out, ConvertOptions(bits=4.0, device="cpu", progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]
