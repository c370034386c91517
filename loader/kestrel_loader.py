"""The `kestrel` loader: Kestrel's own engine behind the public interface."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine.architectures import ARCHITECTURES
from engine.cache import CACHE_TYPES
from engine.config import ModelConfig
from engine.engine import Engine, EngineOptions
from engine.generate import GenerationBackend
from engine.loading import LoadProgress
from engine.placement import PlacementError
from engine.tensor_parallel.errors import TensorParallelError
from engine.tensor_parallel.launched import launched_rank
from loader.base import LoadedModel, LoaderError, UnsupportedFeatureError

NAME = "kestrel"


def can_load(path: Path) -> bool:
    try:
        config = ModelConfig.from_dir(path)
    except ValueError:
        return False
    return config.architecture in ARCHITECTURES and any(path.glob("*.safetensors"))


# Ranges of the engine options outside the settings schema (which checks its own): a value
# past them is refused before anything is unloaded (loader/manager.py calls check_options).
_INT_RANGES = {
    "page_size": (1, 65536),
    "cache_tokens": (1, 2**31),
    "max_batch": (1, 4096),
    "prefill_chunk": (1, 2**20),
    "num_draft_tokens": (1, 64),
    "speculative_max_batch": (1, 4096),
    "max_waiting": (0, 2**20),
    "max_seq_len": (1, 2**22),
    "tp": (1, 1024),
}
_FLOAT_RANGES = {
    "cache_gib": (1e-6, 2**20),
    "rope_alpha": (1e-3, 1e3),
    "rope_scale": (1e-3, 1e3),
    "gpu_reserve_gb": (0.0, 2**20),
    "cache_memory_fraction": (0.01, 1.0),
}

_BOOLS = {
    "cuda_graphs", "split_cuda_graphs", "lora_cuda_graphs", "prefix_caching", "lookahead",
    "fuse_projections", "fuse_kernels", "autosplit", "cpu_offload", "tensor_parallel",
}  # fmt: skip


def check_options(options: Mapping[str, Any]) -> None:
    """A LoaderError naming the first option this loader does not take or whose value is out
    of range (types and ranges only: whether the model fits is known after loading)."""
    known = set(EngineOptions.__dataclass_fields__) | {"tp", "tensor_parallel", "autosplit"}
    known |= {"gpu_split"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise LoaderError(
            f"unknown option(s) for the kestrel loader: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
    for name, value in options.items():
        if value is None:
            continue
        if name in _INT_RANGES:
            low, high = _INT_RANGES[name]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise LoaderError(f"{name}={value!r}: expected a whole number {low}..{high}")
        elif name in _FLOAT_RANGES:
            low_f, high_f = _FLOAT_RANGES[name]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not low_f <= value <= high_f
            ):
                raise LoaderError(f"{name}={value!r}: expected a number {low_f:g}..{high_f:g}")
        elif name in _BOOLS and not isinstance(value, bool):
            raise LoaderError(f"{name}={value!r}: expected true or false")
    if options.get("cache_type") is not None and options["cache_type"] not in CACHE_TYPES:
        raise LoaderError(
            f"cache_type={options['cache_type']!r}: expected one of {', '.join(CACHE_TYPES)}"
        )
    page_size = options.get("page_size")
    if isinstance(page_size, int) and page_size & (page_size - 1):
        raise LoaderError(f"page_size={page_size}: expected a power of two")


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
    progress: LoadProgress | None = None,
    **options: Any,
) -> KestrelModel:
    """`progress(fraction, what)` hears how far the load is (one process; not under TP)."""
    # tensor_parallel=True: one rank per visible GPU; tp=N: N ranks (N > 1 implies TP).
    check_options({**options, "max_seq_len": max_seq_len})
    tp = _tp_world_size(tensor_parallel, options.pop("tp", None), device)
    engine_options = EngineOptions(
        device=device,
        dtype=dtype,
        max_seq_len=max_seq_len,
        cache_type=cache_type,
        gpu_split=list(gpu_split) if gpu_split else None,
        autosplit=autosplit,
        **options,
    )
    try:
        if tp > 1:
            from engine.tensor_parallel.launch import launch_tensor_parallel

            return KestrelModel(path, launch_tensor_parallel(path, engine_options, tp))
        return KestrelModel(path, Engine.load(path, engine_options, progress=progress))
    except (PlacementError, TensorParallelError) as e:
        raise LoaderError(str(e)) from e


def _tp_world_size(tensor_parallel: bool, tp: object, device: str | None) -> int:
    if tp is not None:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise LoaderError(f"tp must be a positive number of ranks, got {tp!r}")
        return tp
    if not tensor_parallel:
        return 1
    launched = launched_rank()
    if launched is not None:  # torchrun started the ranks: as many as it says
        return launched.world_size
    if device is not None and str(device).startswith("cpu"):
        raise LoaderError("tensor_parallel=True on the CPU needs tp=N (the number of ranks)")
    count = torch.cuda.device_count()
    if count < 2:
        raise LoaderError(f"tensor_parallel=True needs 2 or more GPUs, {count} visible")
    return count


def serve_tensor_parallel_rank(path: Path) -> None:
    """Ranks 1.. of a torchrun launch (`torchrun ... -m loader MODEL --tp`, or the API
    server): build this rank's shard of `path` with the options rank 0 loads with (rank 0
    sends them: engine/tensor_parallel/shared_spec.py), and serve rank 0 until it unloads."""
    from engine.tensor_parallel.launch import serve_launched_rank

    try:
        serve_launched_rank(path)
    except TensorParallelError as e:
        raise LoaderError(str(e)) from e


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

    def logits(self, ids: list[int], *, loras: Mapping[str, float] | None = None) -> torch.Tensor:
        engine = self.backend
        assert isinstance(engine, Engine)
        return engine.logits(list(ids), loras=loras)

    def token_nll(
        self, ids: list[int], *, loras: Mapping[str, float] | None = None
    ) -> tuple[float, int]:
        engine = self.backend
        assert isinstance(engine, Engine)
        return engine.token_nll(list(ids), loras=loras)

    def hidden_states(self, ids: list[int]) -> torch.Tensor:
        return self.hidden_states_many([ids])[0]

    def hidden_states_many(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        engine = self.backend
        assert isinstance(engine, Engine)
        if engine.tp_world_size > 1:
            # Rank 0 alone cannot run a forward: every rank must join it.
            raise UnsupportedFeatureError(
                "hidden states (embeddings) are not available with tensor parallelism yet"
            )
        return engine.hidden_states_many([list(ids) for ids in inputs])

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
            "loras": engine.loras.info(),
            "load_seconds": round(engine.load_seconds, 3),
            "cuda_graphs": engine.graphs is not None,
            "placement": _placement_info(engine),
            "draft_model": str(engine.draft_engine.model_dir) if engine.draft_engine else None,
            "scheduler": engine.scheduler.stats(),
        }

    def load_lora(self, path: str | Path, name: str | None = None) -> str:
        """Load a PEFT adapter (any time, also while jobs run); returns its name (default:
        the directory's name). It is inactive until selected (set_loras, settings)."""
        return self._engine().loras.load(path, name)

    def set_loras(self, scales: Mapping[str, float]) -> None:
        """The selection of requests that bring none: {name: scale}; {} turns LoRA off."""
        self._engine().loras.set_default(scales)

    def unload_lora(self, name: str) -> bool:
        """True: freed now; False: jobs still use it, it is freed when they end (and new
        requests naming it are refused meanwhile)."""
        return self._engine().loras.unload(name)

    def loras(self) -> dict[str, dict[str, Any]]:
        return self._engine().loras.info()

    def _engine(self) -> Engine:
        engine = self.backend
        assert isinstance(engine, Engine)
        return engine

    def unload(self) -> None:
        if self.engine is not None:
            self.engine.unload()
            self.engine = None


def _placement_info(engine: Engine) -> dict[str, Any]:
    """Device per layer (ranges), embeddings/head devices, tensor-parallel world size."""
    if engine.placement is not None:
        info: dict[str, Any] = engine.placement.describe()
    else:
        layers = engine.config.num_hidden_layers
        info = {"layers": f"0-{layers - 1} on every rank, 1/{engine.tp_world_size} of each"}
    info["tp_world_size"] = engine.tp_world_size
    if engine.tp_world_size > 1:
        info["mode"] = "tensor_parallel"
        ranks = engine.rank_devices
        info["ranks"] = ranks
        # Memory in use on each rank's GPU as the driver reports it (other ranks are other
        # processes, so torch.cuda.memory_allocated cannot see them).
        info["vram_used_gib"] = {d: _used_gib(d) for d in ranks if d.startswith("cuda")}
        # What each rank held once loaded, by part (engine.tensor_parallel.rank.rank_memory).
        info["rank_bytes"] = engine.rank_memory
    else:
        info["mode"] = "layer_split" if len(engine.devices) > 1 else "single"
    return info


def _used_gib(device: str) -> float:
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return round((total - free) / 2**30, 3)
