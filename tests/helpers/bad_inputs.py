"""Helpers shared by tests/*/test_bad_inputs_*.py: damaged copies of a tiny model and the
check that a model loaded before the damage still serves after each refused load."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import loader
from loader.base import LoadedModel

PROMPT = [5, 17, 99, 203, 11, 42]
GREEDY = {"temperature": 0, "ban_eos_token": True, "max_new_tokens": 4}


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


DROP = object()  # edit_config(key=DROP) removes the key


def edit_config(path: Path, **changes: Any) -> None:
    """Set keys of config.json; a value of `DROP` removes the key."""
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def read_safetensors_header(file: Path) -> tuple[dict[str, Any], bytes]:
    """(header dict, data bytes) of a safetensors file."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_safetensors_raw(file: Path, header: Any, data: bytes) -> None:
    """Write any JSON value as the header, over `data`: for headers safetensors would refuse."""
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def generate(model: LoadedModel) -> str:
    return model.generate(PROMPT, GREEDY)


class Serving:
    """A model loaded before any damage and its first answer: after a refused load it must
    answer the same (the process keeps serving, nothing it holds was touched)."""

    def __init__(self, path: Path) -> None:
        self.model = loader.load(path, "kestrel", device="cpu", max_seq_len=64)
        self.answer = generate(self.model)
        assert self.answer, "the tiny model gave no text"

    def check(self) -> None:
        assert generate(self.model) == self.answer
        cache = self.model.engine.cache
        assert cache.free_pages == cache.num_pages


def cases(argnames: str, table: list[tuple[Any, ...]]) -> Any:
    """`pytest.mark.parametrize` over rows (id, *values): the id names the bad input."""
    import pytest

    return pytest.mark.parametrize(
        argnames, [row[1:] for row in table], ids=[row[0] for row in table]
    )
