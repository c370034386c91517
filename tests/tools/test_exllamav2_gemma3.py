"""tools/exllamav2_gemma3.py: a text-only Gemma 3 checkpoint as the multimodal one that
exllamav2 0.3.2's converter knows, and back (issue 29). A tiny random Gemma 3 from
transformers: the view renames the architecture and puts every tensor under
`language_model.` with the same values; turning that directory back (as exllamav2's output
of the view would be) restores the original names and architecture, and Kestrel reads the
result with the original's logits. Anything that is not a text-only Gemma 3 passes through."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

import loader
from helpers.architectures import CASES
from helpers.model_factory import make_tiny_model
from tools.exllamav2_gemma3 import MULTIMODAL, PREFIX, TEXT_ONLY, from_exllamav2, to_exllamav2


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_a_text_only_gemma3_goes_to_exllamav2s_names_and_back(tmp_path: Path) -> None:
    config_cls, overrides, _ = CASES["gemma3"]
    src = tmp_path / "gemma3"
    make_tiny_model(src, config_cls, **overrides)
    assert _config(src)["architectures"] == [TEXT_ONLY]
    original = _tensors(src)

    view = to_exllamav2(src, tmp_path / "work")
    assert view != src and _config(view)["architectures"] == [MULTIMODAL]
    viewed = _tensors(view)
    assert set(viewed) == {PREFIX + key for key in original}
    assert all(torch.equal(viewed[PREFIX + key], t) for key, t in original.items())
    # Every other setting stays at the top level, where exllamav2 reads it.
    assert {k: v for k, v in _config(view).items() if k != "architectures"} == {
        k: v for k, v in _config(src).items() if k != "architectures"
    }
    assert {p.name for p in src.iterdir()} == {p.name for p in view.iterdir()}
    assert to_exllamav2(src, tmp_path / "work") == view  # made once

    # exllamav2's output of the view keeps its names: back to a text-only directory.
    out = tmp_path / "exl2-out"
    out.mkdir()
    for item in view.iterdir():
        (out / item.name).write_bytes(item.read_bytes())
    from_exllamav2(out)
    assert _config(out)["architectures"] == [TEXT_ONLY]
    back = _tensors(out)
    assert set(back) == set(original)
    assert all(torch.equal(back[key], t) for key, t in original.items())
    assert not list(tmp_path.glob("exl2-out.*"))  # nothing left beside it

    ids = torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    models = [loader.load(d, "kestrel", device="cpu", dtype="float32") for d in (src, out)]
    try:
        torch.testing.assert_close(models[1].logits(ids), models[0].logits(ids))
    finally:
        for m in models:
            m.unload()


def test_other_checkpoints_pass_through(tmp_path: Path) -> None:
    config_cls, overrides, _ = CASES["gemma2"]
    src = tmp_path / "gemma2"
    make_tiny_model(src, config_cls, **overrides)
    assert to_exllamav2(src, tmp_path / "work") == src
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    from_exllamav2(src)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert not (tmp_path / "work").exists()


def test_a_real_multimodal_checkpoint_is_left_as_it_is(tmp_path: Path) -> None:
    """Its language model is under `language_model.` too, but it names a vision tower: not
    one of the views, so its names stay."""
    config_cls, overrides, _ = CASES["gemma3"]
    src = tmp_path / "gemma3"
    make_tiny_model(src, config_cls, **overrides)
    view = to_exllamav2(src, tmp_path / "work")
    config = _config(view)
    config["vision_config"] = {"model_type": "siglip_vision_model"}
    (view / "config.json").write_text(json.dumps(config))
    before = {p.name: p.read_bytes() for p in view.iterdir()}
    from_exllamav2(view)
    assert {p.name: p.read_bytes() for p in view.iterdir()} == before
