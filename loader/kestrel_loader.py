"""The `kestrel` loader: Kestrel's own engine behind the public interface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.architectures import ARCHITECTURES
from engine.config import ModelConfig
from engine.engine import Engine, EngineOptions
from engine.generator import GenerationBackend
from loader.base import LoadedModel, LoaderError

NAME = "kestrel"


def can_load(path: Path) -> bool:
    try:
        config = ModelConfig.from_dir(path)
    except ValueError:
        return False
    return config.architecture in ARCHITECTURES and any(path.glob("*.safetensors"))


def load(
    path: Path,
    *,
    device: str | None = None,
    dtype: str | None = None,
    max_seq_len: int | None = None,
    cache_type: str = "fp16",
    gpu_split: list[float] | None = None,
    autosplit: bool = False,
    tensor_parallel: bool = False,
    **options: Any,
) -> KestrelModel:
    if gpu_split or autosplit or tensor_parallel:
        raise LoaderError(
            "gpu_split, autosplit and tensor_parallel are not supported yet: "
            "this version of Kestrel loads a model onto one device"
        )
    known = set(EngineOptions.__dataclass_fields__) - {"device", "dtype", "max_seq_len"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise LoaderError(
            f"unknown option(s) for the kestrel loader: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
    engine_options = EngineOptions(
        device=device, dtype=dtype, max_seq_len=max_seq_len, cache_type=cache_type, **options
    )
    return KestrelModel(path, Engine.load(path, engine_options))


class KestrelModel(LoadedModel):
    loader_name = NAME

    def __init__(self, path: Path, engine: Engine) -> None:
        super().__init__(path)
        self.engine: Engine | None = engine

    @property
    def backend(self) -> GenerationBackend:
        if self.engine is None:
            raise LoaderError(f"the model {self.path} was unloaded")
        return self.engine

    def logits(self, ids: list[int]) -> torch.Tensor:
        engine = self.backend
        assert isinstance(engine, Engine)
        return engine.logits(list(ids))

    def info(self) -> dict[str, Any]:
        engine = self.backend
        assert isinstance(engine, Engine)
        config = engine.config
        devices = [str(d) for d in engine.devices]
        vram = {
            str(d): round(torch.cuda.memory_allocated(d) / 2**30, 3)
            for d in engine.devices
            if d.type == "cuda"
        }
        return {
            "loader": NAME,
            "path": str(self.path),
            "arch": config.architecture,
            "bits": torch.finfo(engine.dtype).bits,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "context": engine.max_seq_len,
            "cache_type": engine.options.cache_type,
            "cache_tokens": engine.cache.capacity_tokens,
            "cache_bytes_per_token": engine.cache.bytes_per_token,
            "devices": devices,
            "vram_gib": vram,
            "loras": {},
            "load_seconds": round(engine.load_seconds, 3),
            "cuda_graphs": engine.graphs is not None,
            "scheduler": engine.scheduler.stats(),
        }

    def unload(self) -> None:
        if self.engine is not None:
            self.engine.unload()
            self.engine = None
