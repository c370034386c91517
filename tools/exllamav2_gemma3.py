"""Text-only Gemma 3 checkpoints through exllamav2 0.3.2's converter (issue 29).

exllamav2 0.3.2 knows Gemma 3 only as `Gemma3ForConditionalGeneration`, the multimodal
checkpoints, whose language model sits under `language_model.`; a text-only checkpoint
(`Gemma3ForCausalLM`: Gemma-3-270M, 1B) is refused as an unknown architecture. Its Gemma 3
path reads every text setting from the top level of config.json when there is no
`text_config`, loads a vision tower only when `vision_config` names one, and checks no
vision key otherwise, so a text-only checkpoint goes through it as a multimodal one without
a tower: `to_exllamav2` writes that view (the architecture renamed, every tensor under
`language_model.`), and `from_exllamav2` turns the EXL2 directory exllamav2 writes from it
back into a text-only one (prefix dropped, architecture restored) that Kestrel reads.
Nothing else changes: the weights are the same tensors, the quantized ones exllamav2's.

tools/compare_converters.py uses both around exllamav2's converter; any other checkpoint
passes through unchanged.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

TEXT_ONLY = "Gemma3ForCausalLM"
MULTIMODAL = "Gemma3ForConditionalGeneration"
PREFIX = "language_model."


def _architectures(model_dir: Path) -> list[str]:
    config = json.loads((model_dir / "config.json").read_text())
    return list(config.get("architectures") or [])


def needs_view(model_dir: Path) -> bool:
    """Whether `model_dir` is a text-only Gemma 3 checkpoint (exllamav2 needs the view)."""
    return _architectures(model_dir) == [TEXT_ONLY]


def _rewrite(src: Path, dst: Path, rename: Callable[[str], str], architectures: list[str]) -> None:
    """Copy `src` into `dst` (absent: written in a temporary directory beside it, then
    renamed, so it is whole or absent) with every safetensors tensor renamed by `rename`
    and config.json's architectures replaced."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        for item in sorted(src.iterdir()):
            if item.suffix == ".safetensors":
                with safe_open(str(item), framework="pt") as f:
                    metadata = f.metadata()
                    tensors = {rename(key): f.get_tensor(key) for key in f.keys()}
                save_file(tensors, str(tmp / item.name), metadata=metadata)
            elif item.name.endswith(".safetensors.index.json"):
                index = json.loads(item.read_text())
                index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
                (tmp / item.name).write_text(json.dumps(index, indent=2))
            elif item.name == "config.json":
                config = json.loads(item.read_text())
                config["architectures"] = architectures
                (tmp / item.name).write_text(json.dumps(config, indent=2))
            elif item.is_file():
                shutil.copy2(item, tmp / item.name)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def to_exllamav2(src: Path, work: Path) -> Path:
    """The directory to give exllamav2's converter for `src`: `src` itself, or for a
    text-only Gemma 3 checkpoint its multimodal-named view under `work` (made once)."""
    if not needs_view(src):
        return src
    view = work / f"{src.name}-exllamav2-view"
    if not (view / "config.json").is_file():
        _rewrite(src, view, lambda key: PREFIX + key, [MULTIMODAL])
    return view


def from_exllamav2(out: Path) -> None:
    """Turn exllamav2's EXL2 output of a view back into a text-only Gemma 3 directory, in
    place (whole or unchanged: rewritten beside it, then swapped in). Anything else is
    left as it is."""
    config = json.loads((out / "config.json").read_text())
    # A real multimodal checkpoint (its tensors also under `language_model.`) names its
    # vision tower in vision_config; a view has none.
    if config.get("architectures") != [MULTIMODAL] or "vision_config" in config:
        return

    def drop_prefix(key: str) -> str:
        return key[len(PREFIX) :] if key.startswith(PREFIX) else key

    fixed = out.with_name(out.name + ".text-only")
    shutil.rmtree(fixed, ignore_errors=True)
    _rewrite(out, fixed, drop_prefix, [TEXT_ONLY])
    old = out.with_name(out.name + ".view")
    out.rename(old)
    fixed.rename(out)
    shutil.rmtree(old)
