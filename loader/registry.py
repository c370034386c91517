"""The loader registry behind `import loader`: the built-in loaders, entry-point plugins,
`available()`, `settings_schema()` and `load()`. loader/__init__.py re-exports these
lazily (see there why); import them from `loader`, not from here.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from engine.architectures import ARCHITECTURES
from engine.config import MAX_LAYERS, REQUIRED_KEYS, ConfigError, ModelConfig
from engine.weights import WeightStore
from loader import kestrel_loader, transformers_loader
from loader.base import LoadedModel, LoaderError
from loader.settings_schema import SettingsSchema, schema_for

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


def _refuse_unknown_architecture(path: Path) -> None:
    """An architecture Kestrel's engine does not run falls back to transformers; one that
    transformers does not know either is refused here, before anything is loaded, saying
    first what Kestrel supports (transformers' own error would only say to upgrade it)."""
    problem = transformers_loader.architecture_problem(path)
    if problem is None:
        return
    try:
        arch: str | None = ModelConfig.from_dir(path).architecture
    except ConfigError:  # a config Kestrel cannot read may still name its architecture
        named = (_raw_config(path) or {}).get("architectures")
        arch = named[0] if isinstance(named, list) and named and isinstance(named[0], str) else None
    if arch is None or arch in ARCHITECTURES:
        raise LoaderError(f"cannot load {path}: {problem}")
    raise LoaderError(
        f"{path}: architecture '{arch}' is not supported. Kestrel runs "
        f"{', '.join(sorted(ARCHITECTURES))}; its transformers fallback cannot run it either "
        f"({problem})"
    )


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


def detect(path: Path) -> str | None:
    """The first loader that can load `path` (in registration order), or None."""
    return next((name for name, p in _loaders().items() if p.can_load(path)), None)


def check_options(name: str, options: dict[str, Any]) -> None:
    """The loader's own check of its options (types, ranges), where it has one."""
    check = getattr(_loaders().get(name), "check_options", None)
    if check is not None:
        check(options)


def check_model_dir(path: Path) -> None:
    """The checks every loader's model goes through before any loader reads it, so that no
    loader (the transformers fallback included) loads what Kestrel's refuses (WeightError,
    ConfigError): the weights (index shards and *.safetensors symlinks inside the folder,
    readable headers) and the config's sizes. A config Kestrel does not read at all (another
    family of architectures, without its required keys) is left to the loader, but its
    layer count is bounded."""
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists():
        WeightStore(path).close()  # raises WeightError (a ValueError) naming file and tensor
    try:
        ModelConfig.from_dir(path)
        return
    except ConfigError:
        raw = _raw_config(path)
        if raw is None or all(key in raw for key in REQUIRED_KEYS):
            raise
    for key in ("num_hidden_layers", "num_layers", "n_layer"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, int) or not 0 < value <= MAX_LAYERS):
            raise ConfigError(
                f"{path / 'config.json'}: '{key}' is {value!r}; expected 1..{MAX_LAYERS}"
            )


def _raw_config(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(raw, dict) and "text_config" in raw and isinstance(raw["text_config"], dict):
        raw = {**raw["text_config"], **raw}
    return raw if isinstance(raw, dict) else None


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
    progress: Callable[[float, str], None] | None = None,
    **loader_specific: Any,
) -> LoadedModel:
    model_path = Path(path).expanduser()
    if not model_path.exists():
        raise LoaderError(f"model path not found: {path}")
    if not model_path.is_dir():
        raise LoaderError(f"model path is not a directory: {path}")
    loaders = _loaders()
    if loader is None or loader in _BUILTIN:
        # Refusals for safety or validity end here, whichever loader would come next: the
        # fallback to transformers is for architectures Kestrel's engine does not run.
        check_model_dir(model_path)
    if loader is None:
        loader = detect(model_path)
        if loader is None:
            try:  # the config's own error says more than "no loader" where it is the cause
                ModelConfig.from_dir(model_path)
            except ConfigError as e:
                raise LoaderError(f"no loader can load {path}: {e}") from None
            raise LoaderError(
                f"no loader can load {path} (is there a config.json and weights?); "
                f"loaders: {', '.join(loaders)}"
            )
        if loader == transformers_loader.NAME:
            _refuse_unknown_architecture(model_path)
    elif loader not in loaders:
        raise LoaderError(f"unknown loader '{loader}' (available: {', '.join(loaders)})")
    plugin = loaders[loader]
    if progress is not None and _takes(plugin.load, "progress"):
        # Only to loaders that report it (Kestrel's); others load without a bar.
        loader_specific["progress"] = progress
    return plugin.load(
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


def _takes(function: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
