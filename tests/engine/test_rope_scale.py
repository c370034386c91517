"""`rope_scale` (TGW's compress_pos_emb): positions divided by the factor, on any model.

The reference is transformers' own linear RoPE scaling: a copy of the model whose config
says `rope_scaling: {"rope_type": "linear", "factor": 2}` must give what the unchanged model
gives under `rope_scale=2`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import loader
from helpers.model_factory import make_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rope_scale")
    plain = root / "plain"
    make_tiny_llama(plain)
    linear = root / "linear"
    shutil.copytree(plain, linear)
    config = json.loads((linear / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (linear / "config.json").write_text(json.dumps(config))
    return plain, linear


IDS = list(range(3, 60))


def test_rope_scale_is_linear_scaling(models: tuple[Path, Path]) -> None:
    plain, linear = models
    scaled = loader.load(plain, "kestrel", device="cpu", rope_scale=2.0)
    try:
        got = scaled.logits(IDS)
    finally:
        scaled.unload()
    reference = loader.load(linear, "transformers", device="cpu", dtype="float32")
    try:
        want = reference.logits(IDS)
    finally:
        reference.unload()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    unscaled = loader.load(plain, "kestrel", device="cpu")
    try:
        assert not torch.allclose(unscaled.logits(IDS), got, atol=1e-3)  # it does something
    finally:
        unscaled.unload()


def test_rope_scale_is_a_kestrel_option_checked_before_loading(models) -> None:
    plain, _ = models
    schema = loader.settings_schema("kestrel")
    assert "rope_scale" in schema.names()
    with pytest.raises(loader.LoaderError, match="rope_scale"):
        loader.load(plain, "kestrel", device="cpu", rope_scale=0.0)
