"""The one "current model" that the web UI, the API and extensions share.

`ModelManager` owns a models directory and a LoRA directory, lists what is in them
(labelled by format, size and bits), loads one model at a time through `loader.load`
behind a lock, and resolves names so that a request can never reach outside those
directories: a name is a single path component of an entry that exists there.

    manager = ModelManager(models_dir=Path("models"), loras_dir=Path("loras"))
    manager.list_models()        # [ModelEntry(name, path, format, size_bytes, bits), ...]
    model = manager.load("SmolLM2-135M-Instruct-exl2-4.0", max_seq_len=4096)
    manager.current()            # the LoadedModel (ModelNotLoadedError if none)
    manager.unload()

A `.gguf` file in the models directory is listed with format "gguf"; loading it imports it
once into a sibling FP16 directory (`<stem>-fp16`) and loads that.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import loader
from engine.paths import PathConfinementError, confined_path
from loader.base import LoadedModel, LoaderError


class ModelNotLoadedError(LoaderError):
    """No model is loaded (load one first)."""


class UnknownNameError(LoaderError):
    """A model or LoRA name that is not an entry of its directory."""


class ModelPinnedError(LoaderError):
    """The loaded model cannot be switched or unloaded on request (the reason says why)."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    format: str  # "exl2", "gptq", "fp16", "bf16", "fp32", "gguf" or "unknown"
    size_bytes: int
    bits: float | None  # bits per weight for quantized models, else None

    @property
    def label(self) -> str:
        """A short human label: "exl2 4.0 bpw, 0.11 GB"."""
        bits = f" {self.bits:g} bpw" if self.bits is not None else ""
        return f"{self.format}{bits}, {self.size_bytes / 1e9:.2f} GB"


@dataclass(frozen=True)
class LoraEntry:
    name: str
    path: Path
    size_bytes: int
    rank: int | None
    base_model: str | None


def resolve_name(directory: Path, name: str, what: str = "model") -> Path:
    """`directory/name` if `name` is one existing entry of `directory`, else a clear error.

    Rejects anything that could escape the directory (engine/paths.py): separators, "..",
    absolute paths, empty names, NUL bytes, and symlinks that point outside it."""
    try:
        path = confined_path(directory, name, what=what, single_component=True)
    except PathConfinementError as e:
        raise UnknownNameError(str(e)) from None
    if not path.exists():
        raise UnknownNameError(f"no {what} named {name!r} in {directory}")
    return path


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe_model(path: Path) -> ModelEntry:
    """Format, size and bits of one models-directory entry (a directory or a .gguf file)."""
    if path.is_file():
        fmt = "gguf" if path.suffix.lower() == ".gguf" else "unknown"
        return ModelEntry(path.name, path, fmt, path.stat().st_size, None)
    config = _read_json(path / "config.json")
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    bits: float | None = None
    if method in {"exl2", "gptq"}:
        fmt = method
        raw_bits = quant.get("bits")
        bits = float(raw_bits) if isinstance(raw_bits, int | float) else None
    elif any(path.glob("*.gguf")):
        fmt = "gguf"
    elif config:
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
        fmt = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, "fp16")
    else:
        fmt = "unknown"
    return ModelEntry(path.name, path, fmt, _size(path), bits)


def describe_lora(path: Path) -> LoraEntry:
    config = _read_json(path / "adapter_config.json")
    rank = config.get("r")
    base = config.get("base_model_name_or_path")
    return LoraEntry(
        path.name,
        path,
        _size(path),
        rank if isinstance(rank, int) else None,
        base if isinstance(base, str) else None,
    )


class ModelManager:
    """Thread-safe holder of the current model, confined to its directories."""

    def __init__(self, models_dir: Path, loras_dir: Path | None = None) -> None:
        self.models_dir = Path(models_dir).expanduser()
        self.loras_dir = Path(loras_dir).expanduser() if loras_dir else None
        self._lock = threading.RLock()
        self._model: LoadedModel | None = None
        self._name: str | None = None
        self._options: dict[str, Any] = {}
        self._pinned: str | None = None

    def pin(self, reason: str) -> None:
        """Refuse model loads and unload requests from now on, saying `reason` (e.g. ranks
        torchrun started cannot be started again); `unload()` itself, for shutdown, works."""
        self._pinned = reason

    def check_switch(self) -> None:
        """Raise ModelPinnedError when the model may not be switched or unloaded on request."""
        if self._pinned is not None:
            raise ModelPinnedError(self._pinned)

    # -- listing ----------------------------------------------------------------------
    def list_models(self) -> list[ModelEntry]:
        if not self.models_dir.is_dir():
            return []
        entries = []
        for path in sorted(self.models_dir.iterdir(), key=lambda p: p.name.lower()):
            if path.name.startswith("."):  # partial imports and conversions
                continue
            if path.is_dir() and not (path / "config.json").is_file():
                continue
            if path.is_file() and path.suffix.lower() != ".gguf":
                continue
            entries.append(describe_model(path))
        return entries

    def list_loras(self) -> list[LoraEntry]:
        if self.loras_dir is None or not self.loras_dir.is_dir():
            return []
        return [
            describe_lora(p)
            for p in sorted(self.loras_dir.iterdir(), key=lambda p: p.name.lower())
            if p.is_dir() and (p / "adapter_config.json").is_file()
        ]

    def resolve_model(self, name: str) -> Path:
        return resolve_name(self.models_dir, name, "model")

    def resolve_lora(self, name: str) -> Path:
        if self.loras_dir is None:
            raise UnknownNameError("no LoRA directory is configured")
        return resolve_name(self.loras_dir, name, "LoRA")

    # -- the current model ------------------------------------------------------------
    @property
    def name(self) -> str | None:
        return self._name

    @property
    def options(self) -> dict[str, Any]:
        return dict(self._options)

    def current(self) -> LoadedModel:
        model = self._model
        if model is None:
            raise ModelNotLoadedError("no model is loaded")
        return model

    def is_loaded(self) -> bool:
        return self._model is not None

    def load(
        self,
        name: str,
        loader_name: str | None = None,
        *,
        progress: Callable[[str], None] | None = None,
        weights_progress: Callable[[float, str], None] | None = None,
        **options: Any,
    ) -> LoadedModel:
        """Unload the current model (if any) and load `name` from the models directory.
        `progress(message)` hears each stage (a GGUF import, the load);
        `weights_progress(fraction, what)` how far the load itself is, where the loader
        reports it (Kestrel's does, per weight).

        A bad name, or a bad value of a control in the loader's settings schema, fails
        before anything is unloaded. On a later failure the manager holds no model and the
        error propagates: a half-loaded model never stays around holding memory."""
        self.check_switch()
        path = self.resolve_model(name)
        draft = options.get("draft_model")
        load_options = dict(options)
        if draft:  # a name from the UI or the API: confined to the models directory too
            load_options["draft_model"] = resolve_name(self.models_dir, draft, "draft model")
        # A bad value of a control the loader publishes (or of an option its check_options
        # knows) is refused before the current model is unloaded.
        if loader_name is not None:
            schema = loader.settings_schema(loader_name)
            schema.check({k: v for k, v in options.items() if k in schema.names()})
        chosen = loader_name or loader.detect(path)
        if chosen is not None:
            loader.check_options(chosen, options)
        with self._lock:
            self.unload()
            path = self._gguf_imported(path, progress)
            if draft:
                draft_dir = self._gguf_imported(load_options["draft_model"], progress)
                load_options["draft_model"] = str(draft_dir)
            if progress:
                progress(f"loading {name}")
            model = loader.load(path, loader_name, progress=weights_progress, **load_options)
            self._model, self._name, self._options = model, name, dict(options)
            return model

    def adopt(self, model: LoadedModel, name: str) -> None:
        """Hold a model loaded elsewhere (e.g. by a CLI flag with a path outside models/)."""
        with self._lock:
            self.unload()
            self._model, self._name = model, name

    def unload(self) -> None:
        with self._lock:
            model, self._model, self._name, self._options = self._model, None, None, {}
            if model is not None:
                model.unload()
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except ImportError:  # pragma: no cover - torch is a hard dependency
                pass

    def _gguf_imported(self, path: Path, progress: Callable[[str], None] | None) -> Path:
        """`path`, or for a .gguf entry its FP16 import (made once)."""
        return self._import_gguf(path, progress) if describe_model(path).format == "gguf" else path

    def _import_gguf(self, path: Path, progress: Callable[[str], None] | None) -> Path:
        from engine.gguf_import import import_gguf

        gguf = path if path.is_file() else next(path.glob("*.gguf"))
        target = self.models_dir / f"{gguf.stem}-fp16"
        if not (target / "config.json").is_file():
            if progress:
                progress(f"importing {gguf.name} to {target.name} (once)")
            import_gguf(gguf, target, progress=progress is not None, overwrite=True)
        return target
