"""Kestrel's pluggable loader interface (the public, stable API).

    import loader
    loader.available()                       # ["kestrel", "transformers", ...]
    m = loader.load(path, loader=None, device=None, dtype=None, max_seq_len=None, ...)
    m.generate("Once upon a time", {"max_new_tokens": 32, "temperature": 0})

A third-party loader registers through the `kestrel.loaders` entry-point group: the entry
point names a module (or object) with `can_load(path) -> bool` and `load(path, **options)
-> LoadedModel`, the same shape as loader/kestrel_loader.py.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from engine.config import ConfigError, ModelConfig
from loader import kestrel_loader, transformers_loader
from loader.base import Chunk, LoadedModel, LoaderError, UnsupportedFeatureError
from loader.settings_schema import Control, SettingsSchema, schema_for

ENTRY_POINT_GROUP = "kestrel.loaders"


class LoaderPlugin(Protocol):
    def can_load(self, path: Path) -> bool: ...
    def load(self, path: Path, **options: Any) -> LoadedModel: ...


# Order matters: when no loader is named, the first that can load the files wins.
_BUILTIN: dict[str, LoaderPlugin | ModuleType] = {
    kestrel_loader.NAME: kestrel_loader,
    transformers_loader.NAME: transformers_loader,
}
_registered: dict[str, LoaderPlugin | ModuleType] = {}


def register(name: str, plugin: LoaderPlugin | ModuleType) -> None:
    """Register a loader at run time (entry points do this without code)."""
    _registered[name] = plugin


def _loaders() -> dict[str, LoaderPlugin | ModuleType]:
    found: dict[str, LoaderPlugin | ModuleType] = dict(_BUILTIN)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            try:
                found[ep.name] = ep.load()
            except Exception as e:  # a broken plugin must not break the built-in loaders
                import warnings

                warnings.warn(f"loader plugin '{ep.name}' failed to import: {e}", stacklevel=2)
    found.update(_registered)
    return found


def available() -> list[str]:
    return list(_loaders())


def settings_schema(name: str) -> SettingsSchema:
    """The load-time controls of loader `name`, for a UI to render (see settings_schema.py)."""
    loaders = _loaders()
    if name not in loaders:
        raise LoaderError(f"unknown loader '{name}' (available: {', '.join(loaders)})")
    return schema_for(name, loaders[name])


def pick(path: str | Path) -> str | None:
    """The loader that `load(path)` uses when none is named (the first that can load the
    files), or None when none can."""
    model_path = Path(path).expanduser()
    return next((name for name, p in _loaders().items() if p.can_load(model_path)), None)


def load(
    path: str | Path,
    loader: str | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    max_seq_len: int | None = None,
    cache_type: str = "fp16",
    gpu_split: list[float] | None = None,
    autosplit: bool = False,
    tensor_parallel: bool = False,
    **loader_specific: Any,
) -> LoadedModel:
    model_path = Path(path).expanduser()
    if not model_path.exists():
        raise LoaderError(f"model path not found: {path}")
    if not model_path.is_dir():
        raise LoaderError(f"model path is not a directory: {path}")
    loaders = _loaders()
    if loader is None:
        loader = pick(model_path)
        if loader is None:
            try:  # the config's own error says more than "no loader" where it is the cause
                ModelConfig.from_dir(model_path)
            except ConfigError as e:
                raise LoaderError(f"no loader can load {path}: {e}") from None
            raise LoaderError(
                f"no loader can load {path} (is there a config.json and weights?); "
                f"loaders: {', '.join(loaders)}"
            )
    elif loader not in loaders:
        raise LoaderError(f"unknown loader '{loader}' (available: {', '.join(loaders)})")
    return loaders[loader].load(
        model_path,
        device=device,
        dtype=dtype,
        max_seq_len=max_seq_len,
        cache_type=cache_type,
        gpu_split=gpu_split,
        autosplit=autosplit,
        tensor_parallel=tensor_parallel,
        **loader_specific,
    )


__all__ = [
    "Chunk",
    "Control",
    "LoadedModel",
    "LoaderError",
    "UnsupportedFeatureError",
    "available",
    "load",
    "pick",
    "register",
    "SettingsSchema",
    "settings_schema",
]
