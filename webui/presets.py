"""Generation presets: TGW-style YAML files of sampler values, plus a few built in.

A preset file (`<presets dir>/<name>.yaml`) maps sampler state keys to values and holds only
what differs from the defaults, as TGW's presets do; loading one starts from the defaults
(webui.sampler_controls) and applies it, so a preset never inherits the previous one's
leftovers. Presets cover the samplers (`sampler_controls.PRESET_NAMES`), not max_new_tokens,
seed, stop strings or truncation length. Built-in presets live in code and cannot be
overwritten or deleted; a user file of the same name is refused rather than silently
shadowing it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.storage import StorageError, read_yaml, safe_name, write_yaml
from webui import sampler_controls

BUILTIN: dict[str, dict[str, Any]] = {
    # SamplingSettings' own defaults: plain sampling at temperature 1.
    "Default": {},
    # TGW's "Debug-deterministic": greedy decoding, for reproducible output.
    "Deterministic": {"do_sample": False},
    # TGW's "min_p": a modern general-purpose preset.
    "min_p": {"min_p": 0.05},
    # TGW's "simple-1".
    "simple-1": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.15},
    # Creative writing: higher temperature held in check by min_p, DRY against loops.
    "Creative": {"temperature": 1.2, "min_p": 0.1, "dry_multiplier": 0.8},
}


def _known(values: dict[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(set(values) - set(sampler_controls.PRESET_NAMES))
    if unknown:
        raise StorageError(
            f"{source}: unknown or non-sampler setting(s) {', '.join(unknown)} "
            f"(a preset holds sampler settings, e.g. temperature, top_p, min_p)"
        )
    return values


class Presets:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def names(self) -> list[str]:
        user = []
        if self.directory.is_dir():
            user = sorted(
                p.stem for p in self.directory.glob("*.yaml") if not p.name.startswith(".")
            )
        return list(BUILTIN) + [n for n in user if n not in BUILTIN]

    def _path(self, name: str) -> Path:
        return self.directory / f"{safe_name(name, 'preset')}.yaml"

    def load(self, name: str) -> dict[str, Any]:
        """Every sampler control's value under preset `name` (defaults plus its keys)."""
        if name in BUILTIN:
            overrides = BUILTIN[name]
        else:
            path = self._path(name)
            if not path.is_file():
                raise StorageError(f"no preset named {name!r} in {self.directory}")
            data = read_yaml(path)
            if data is None:
                data = {}
            if not isinstance(data, dict):
                raise StorageError(f"{path} must map setting names to values")
            overrides = _known(data, str(path))
        defaults = sampler_controls.defaults()
        sampler_controls.validate({**defaults, **overrides})  # names a bad key now, not mid-chat
        return {n: overrides.get(n, defaults[n]) for n in sampler_controls.PRESET_NAMES}

    def save(self, name: str, values: dict[str, Any]) -> Path:
        """Write the sampler values that differ from the defaults (other keys of `values`
        are ignored); returns the file written."""
        clean = safe_name(name, "preset", new=True)
        if clean in BUILTIN:
            raise StorageError(f"{clean!r} is a built-in preset; save under another name")
        base = sampler_controls.defaults()
        sampler_controls.validate({**base, **values})
        samplers = {k: v for k, v in values.items() if k in sampler_controls.PRESET_NAMES}
        diff = {k: _plain(v) for k, v in samplers.items() if _plain(v) != _plain(base[k])}
        path = self._path(clean)
        write_yaml(path, diff)
        return path

    def delete(self, name: str) -> None:
        if name in BUILTIN:
            raise StorageError(f"{name!r} is a built-in preset and cannot be deleted")
        path = self._path(name)
        if not path.is_file():
            raise StorageError(f"no preset named {name!r} in {self.directory}")
        path.unlink()


def _plain(value: Any) -> Any:
    """Gradio hands integer sliders over as floats: 40.0 and 40 are the same setting."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
