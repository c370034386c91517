"""What the Model tab checks before it unloads the working model for another one: the loader
that will load the files, the options it takes (by the names the page shows), and that
every weights file opens. A load that is bound to fail then fails with the old model still
loaded, and the error names the option or file at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import loader
from loader.manager import ModelManager


class LoadCheckError(ValueError):
    """The load would fail; the message says why (an option, a loader, a file)."""


def loader_for(manager: ModelManager, name: str, chosen: str | None) -> str | None:
    """The loader that will load model `name`: the chosen one, else the one picked from the
    files (None for a GGUF file, imported first, or when no loader can load it)."""
    if chosen:
        return chosen
    path = manager.resolve_model(name)
    return loader.detect(path) if path.is_dir() else None


def check_load(
    manager: ModelManager, name: str, chosen: str | None, options: dict[str, Any]
) -> str | None:
    """Raise LoadCheckError when loading `name` with `options` cannot work; returns the
    loader that will be used (None where it is only known at load time)."""
    try:
        path = manager.resolve_model(name)
    except Exception as e:
        raise LoadCheckError(str(e)) from None
    if not path.is_dir():  # a .gguf file: its import decides
        return chosen
    used = loader_for(manager, name, chosen)
    if used is None:
        raise LoadCheckError(
            f"no loader can load {name}: is there a config.json and weights? "
            f"(loaders: {', '.join(loader.available())})"
        )
    try:
        schema = loader.settings_schema(used)
    except Exception as e:
        raise LoadCheckError(str(e)) from None
    takes = set(schema.names())
    refused = sorted(set(options) - takes)
    if refused:
        raise LoadCheckError(
            f"the {used} loader does not take {', '.join(refused)} (leave "
            f"{'it' if len(refused) == 1 else 'them'} unset, or choose another loader)"
        )
    try:
        schema.check(options)
    except Exception as e:
        raise LoadCheckError(str(e)) from None
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(weights)
    return used


def _check_safetensors(path: Path) -> None:
    """The file's header parses and its tensors fit in the file (a truncated or garbage
    file fails here, before anything is unloaded)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:
        raise LoadCheckError(f"{path.name} is not a readable safetensors file: {e}") from None
