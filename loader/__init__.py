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

import importlib
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loader.base import Chunk, LoadedModel, LoaderError, UnsupportedFeatureError
    from loader.registry import (
        available,
        check_model_dir,
        check_options,
        detect,
        register,
        settings_schema,
    )
    from loader.settings_schema import Control, SettingsSchema

# Where each public name lives. They are imported on first use, not here: the TGW
# installer (`python -m loader.tgw`, `kestrel-tgw`) only edits text files and must run
# without importing the engine, torch or triton.
_EXPORTS: dict[str, str] = {
    "Chunk": "loader.base",
    "LoadedModel": "loader.base",
    "LoaderError": "loader.base",
    "UnsupportedFeatureError": "loader.base",
    "Control": "loader.settings_schema",
    "SettingsSchema": "loader.settings_schema",
    "ENTRY_POINT_GROUP": "loader.registry",
    "LoaderPlugin": "loader.registry",
    "available": "loader.registry",
    "check_model_dir": "loader.registry",
    "check_options": "loader.registry",
    "detect": "loader.registry",
    "register": "loader.registry",
    "_registered": "loader.registry",
}


def load(path: str | Path, loader: str | None = None, **options: Any) -> LoadedModel:
    """Load the model at `path` with `loader` (None: the first that can), options as
    loader/registry.py's `load` takes them (device, dtype, max_seq_len, cache_type,
    gpu_split, autosplit, tensor_parallel, progress and the loader's own, such as tp).

    With `tp=N` (N > 1) the other ranks start first, before this imports torch and the
    engine (if it has not yet), so that their start-up runs beside this process's
    (loader/early_ranks.py); a load that does not take them stops them."""
    from loader import early_ranks

    started = early_ranks.prestart_for(options.get("tp"), loader)
    try:
        from loader.registry import load as load_with

        return load_with(path, loader, **options)
    finally:
        if started:
            early_ranks.discard()  # nothing when the launch took them


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        try:  # a submodule not imported yet, e.g. `loader.base` after `import loader`
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | {"settings_schema"})


class _Package(types.ModuleType):
    """`loader.settings_schema` is the function, as it was when this file imported
    everything at once, although a submodule of that name exists: importing the submodule
    later would otherwise replace the function with the module (the import system sets the
    package attribute)."""

    @property
    def settings_schema(self) -> Any:
        override = self.__dict__.get("_settings_schema_override")
        if override is not None:
            return override
        from loader.registry import settings_schema

        return settings_schema

    @settings_schema.setter
    def settings_schema(self, value: Any) -> None:
        if not isinstance(value, types.ModuleType):  # e.g. a test's monkeypatch
            self.__dict__["_settings_schema_override"] = value


sys.modules[__name__].__class__ = _Package


__all__ = [
    "Chunk",
    "Control",
    "LoadedModel",
    "LoaderError",
    "UnsupportedFeatureError",
    "available",
    "check_model_dir",
    "check_options",
    "detect",
    "load",
    "register",
    "SettingsSchema",
    "settings_schema",
]
