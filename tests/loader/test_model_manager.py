"""loader.manager: listing, name confinement, load/unload of the shared current model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager, ModelNotLoadedError, UnknownNameError, resolve_name


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_tiny_llama(root / "tiny-fp32")
    fake_exl2 = root / "tiny-exl2"
    fake_exl2.mkdir()
    config = {"architectures": ["LlamaForCausalLM"]}
    config["quantization_config"] = {"quant_method": "exl2", "bits": 4.0}
    (fake_exl2 / "config.json").write_text(json.dumps(config))
    (root / "notes.txt").write_text("not a model")
    (root / ".tiny.partial-123").mkdir()
    (root / "weights.gguf").write_bytes(b"GGUF" + bytes(60))
    return root


def test_lists_models_with_formats(models_dir: Path) -> None:
    entries = {e.name: e for e in ModelManager(models_dir).list_models()}
    assert set(entries) == {"tiny-fp32", "tiny-exl2", "weights.gguf"}
    assert entries["tiny-fp32"].format == "fp32"
    assert entries["tiny-exl2"].format == "exl2" and entries["tiny-exl2"].bits == 4.0
    assert entries["tiny-exl2"].label.startswith("exl2 4 bpw")
    assert entries["weights.gguf"].format == "gguf" and entries["weights.gguf"].size_bytes == 64
    assert entries["tiny-fp32"].size_bytes > 0


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../etc", "a/b", "/etc/passwd", "a\\b", "x\x00y", "missing"]
)
def test_names_are_confined(models_dir: Path, name: str) -> None:
    with pytest.raises(UnknownNameError):
        resolve_name(models_dir, name)


def test_symlink_out_of_the_directory_is_refused(models_dir: Path, tmp_path: Path) -> None:
    link = models_dir / "escape"
    os.symlink(tmp_path, link)
    try:
        with pytest.raises(UnknownNameError, match="outside"):
            resolve_name(models_dir, "escape")
    finally:
        link.unlink()


def test_load_generate_unload(models_dir: Path) -> None:
    manager = ModelManager(models_dir)
    with pytest.raises(ModelNotLoadedError):
        manager.current()
    model = manager.load("tiny-fp32", device="cpu", dtype="float32", max_seq_len=128)
    assert manager.name == "tiny-fp32" and manager.current() is model
    assert manager.options["max_seq_len"] == 128
    text = model.generate([1, 5, 9], {"max_new_tokens": 4, "temperature": 0})
    assert isinstance(text, str)
    manager.unload()
    assert not manager.is_loaded() and manager.name is None


def test_failed_load_leaves_nothing_loaded(models_dir: Path) -> None:
    manager = ModelManager(models_dir)
    manager.load("tiny-fp32", device="cpu", dtype="float32", max_seq_len=64)
    with pytest.raises(Exception):  # noqa: B017 - the fake EXL2 dir has no weights
        manager.load("tiny-exl2", device="cpu")
    assert not manager.is_loaded()


def test_loras_listing(tmp_path: Path) -> None:
    (tmp_path / "style").mkdir()
    (tmp_path / "style" / "adapter_config.json").write_text(
        json.dumps({"r": 8, "base_model_name_or_path": "tiny"})
    )
    (tmp_path / "junk").mkdir()
    manager = ModelManager(tmp_path, loras_dir=tmp_path)
    [entry] = manager.list_loras()
    assert entry.name == "style" and entry.rank == 8 and entry.base_model == "tiny"
    assert manager.resolve_lora("style") == tmp_path / "style"
    with pytest.raises(UnknownNameError):
        manager.resolve_lora("../style")
