"""Lazy access to a model directory's safetensors tensors.

`WeightStore(model_dir)` indexes every tensor of a single `model.safetensors`, a sharded
checkpoint (`model.safetensors.index.json`), or any set of `*.safetensors` files (as
exllamav2 writes them), reading only the headers. Tensors are read one at a time on demand,
so a model larger than host memory streams to the GPU layer by layer.

Every file's header is validated when it is indexed: a truncated or corrupt file, or a
tensor whose byte range does not fit its dtype and shape, raises `WeightError` naming the
file (and tensor) before any weight is loaded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}


class WeightError(ValueError):
    """A weight file or tensor is missing, corrupt or does not fit the model."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


class WeightStore:
    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._tensors: dict[str, TensorInfo] = {}
        self._handles: dict[Path, object] = {}
        for file in self._files():
            for name, info in _read_header(file).items():
                if name in self._tensors:
                    raise WeightError(
                        f"tensor '{name}' appears in both {self._tensors[name].file.name} "
                        f"and {file.name}"
                    )
                self._tensors[name] = info

    def _files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightError(f"cannot read {index}: {e}") from e
            files = sorted({self.model_dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise WeightError(f"{index} names missing shard(s): {', '.join(missing)}")
            return files
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in self.model_dir.glob("*.bin")) + sorted(
                p.name for p in self.model_dir.glob("*.pt")
            )
            hint = (
                f" (found {', '.join(found)}: pickle checkpoints are not loaded because they "
                "can run code; convert them to safetensors)"
                if found
                else ""
            )
            raise WeightError(f"no .safetensors files in {self.model_dir}{hint}")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise WeightError(f"tensor '{name}' not found in {self.model_dir}") from None

    def get(
        self,
        name: str,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Read one tensor; `shape`, when given, is checked before reading the data."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise WeightError(
                f"tensor '{name}' in {info.file.name} has shape {list(info.shape)}, "
                f"the model expects {list(shape)}"
            )
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
        tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor.to(device)

    def close(self) -> None:
        self._handles.clear()


def _read_header(file: Path) -> dict[str, TensorInfo]:
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightError(f"{file}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8 or header_len > 100_000_000:
            raise WeightError(f"{file}: corrupt or truncated safetensors header")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise WeightError(f"{file}: corrupt safetensors header ({e})") from e
    data_size = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, itemsize = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightError(f"{file}: tensor '{name}' has an unreadable header entry") from e
        numel = 1
        for d in shape:
            numel *= d
        if end - start != numel * itemsize:
            raise WeightError(
                f"{file}: tensor '{name}' ({entry['dtype']} {list(shape)}) needs "
                f"{numel * itemsize} bytes but its header gives {end - start}"
            )
        if end > data_size:
            raise WeightError(
                f"{file} is truncated: tensor '{name}' ends at byte {end} of the data, "
                f"the file holds {data_size}"
            )
        tensors[name] = TensorInfo(file=file, dtype=dtype, shape=shape)
    return tensors
