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
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import KestrelError
from engine.paths import PathConfinementError, confined_path, hub_snapshot_repo
from engine.staged_reads import StagedReader

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


class WeightError(KestrelError, ValueError):
    """A weight file or tensor is missing, corrupt or does not fit the model."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # of its data in the file


# A base-model checkpoint (the backbone saved without its task head: Qwen3-Embedding ships
# so) names the backbone's tensors without the "model." prefix of the causal-LM classes.
_BACKBONE_ROOTS = ("embed_tokens.", "layers.", "norm.")


class WeightStore:
    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._tensors: dict[str, TensorInfo] = {}
        self._handles: dict[Path, object] = {}
        self._fds: dict[Path, int] = {}  # files opened for part reads
        self._stored: dict[str, str] = {}  # name -> the name in the file, where they differ
        # Bytes of tensor data asked of the files so far (whole tensors and parts): a
        # tensor-parallel rank asks for about its share of the model (cut_load.py). (Columns
        # in runs narrower than a page are read as whole rows: see _read_rows_and_gather.)
        self.bytes_read = 0
        # What the reads cost: bytes brought in from the files (whole rows included), read
        # calls, seconds spent reading, and seconds spent placing what was read (the cast,
        # the finite check and the copy to the device: tensor-parallel load phases,
        # engine/tensor_parallel/load_phases.py).
        self._whole_bytes = 0
        self._whole_calls = 0
        self.read_seconds = 0.0
        # Part reads: threads, reused staging buffers, asynchronous copies to a GPU.
        self.reader = StagedReader()
        self.place_seconds = 0.0
        # Of the two above, the seconds spent on a load's quantized linears' reads (by its
        # read-ahead worker, beside the load's thread: engine/read_ahead.py), and what those
        # reads cost the load's thread (waiting for the worker, or reading itself).
        self.ahead_seconds = 0.0
        self.ahead_wait_seconds = 0.0
        for file in self._files():
            for name, info in _read_header(file).items():
                if name in self._tensors:
                    raise WeightError(
                        f"tensor '{name}' appears in both {self._tensors[name].file.name} "
                        f"and {file.name}"
                    )
                self._tensors[name] = info
        names = self._tensors
        if not any(n.startswith("model.") for n in names) and any(
            n.startswith("layers.") for n in names
        ):
            # Indexed under the causal-LM names; read under the stored ones.
            renamed = {}
            for name, info in names.items():
                public = f"model.{name}" if name.startswith(_BACKBONE_ROOTS) else name
                renamed[public] = info
                if public != name:
                    self._stored[public] = name
            self._tensors = renamed

    def _files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightError(f"cannot read {index}: {e}") from e
            if not isinstance(weight_map, dict) or not weight_map:
                raise WeightError(f"{index}: 'weight_map' must be a non-empty object")
            try:  # an index names its shards: they must lie in the model directory
                # Checked once per distinct name, not per tensor (resolving symlinks of 2000
                # names took 0.85 s of an 8B model's load); a set of the resolved paths, as
                # "m.safetensors" and "./m.safetensors" are one shard.
                names: list[object] = []  # distinct, in order; a bad one need not hash
                for name in weight_map.values():
                    if name not in names:
                        names.append(name)
                # A Hugging Face cache snapshot's files link into its repository's blobs/.
                fence = hub_snapshot_repo(self.model_dir)
                files = sorted(
                    {confined_path(self.model_dir, f, what="shard", within=fence) for f in names}
                )
            except PathConfinementError as e:
                raise WeightError(f"{index}: {e}") from None
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise WeightError(f"{index} names missing shard(s): {', '.join(missing)}")
            return files
        files = sorted(self.model_dir.glob("*.safetensors"))
        fence = hub_snapshot_repo(self.model_dir)
        for file in files:  # a symlink to a file elsewhere is refused as an index's shard is
            try:
                confined_path(self.model_dir, file.name, what="weights file", within=fence)
            except PathConfinementError as e:
                raise WeightError(
                    f"{e}; copy the file into the model directory (a download tool's "
                    "--local-dir does that)"
                ) from None
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
        """Read one tensor; `shape`, when given, is checked before reading the data.

        With `dtype` the tensor is a model weight: it must be floating point and, after the
        cast, finite. A NaN or inf weight is refused, not warned about: it turns every
        logit it reaches into NaN, and the model would answer with garbage or token 0."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise WeightError(
                f"tensor '{name}' in {info.file.name} has shape {list(info.shape)}, "
                f"the model expects {list(shape)}"
            )
        _check_weight_dtype(name, info, dtype)
        tensor = self._read(name, info)
        return self._place(name, info, tensor, dtype, device)

    def get_part(
        self,
        name: str,
        dim: int,
        runs: list[tuple[int, int]],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Indices [a, b) of each run along `dim` (0 or 1) of a 1-D or 2-D tensor, concatenated
        in order: only those bytes are read from the file. `dtype` as
        for `get` (a weight: cast, and refused if not finite)."""
        info = self.info(name)
        if dim >= len(info.shape) or dim > 1 or len(info.shape) > 2:
            raise WeightError(
                f"tensor '{name}' in {info.file.name} has shape {list(info.shape)}: cannot read "
                f"a part along dimension {dim}"
            )
        size = info.shape[dim]
        bad = [(a, b) for a, b in runs if not 0 <= a < b <= size]
        if bad or not runs:
            raise WeightError(
                f"tensor '{name}' in {info.file.name}: parts {bad or runs} do not lie within "
                f"its {size} entries along dimension {dim}"
            )
        _check_weight_dtype(name, info, dtype)
        started = time.perf_counter()
        try:
            tensor = self._read_runs(info, dim, runs, torch.device(device))
        except OSError as e:
            raise WeightError(f"{info.file}: cannot read tensor '{name}' ({e})") from None
        self.read_seconds += time.perf_counter() - started
        self.bytes_read += tensor.numel() * tensor.element_size()
        return self._place(name, info, tensor, dtype, device)

    def _place(
        self,
        name: str,
        info: TensorInfo,
        tensor: torch.Tensor,
        dtype: torch.dtype | None,
        device: torch.device | str,
    ) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return _placed(name, info, tensor, dtype, device)
        finally:
            self.place_seconds += time.perf_counter() - started

    def _read(self, name: str, info: TensorInfo) -> torch.Tensor:
        """The whole tensor, through safetensors."""
        started = time.perf_counter()
        try:
            handle = self._handles.get(info.file)
            if handle is None:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            stored = self._stored.get(name, name)
            tensor: torch.Tensor = handle.get_tensor(stored)  # type: ignore[attr-defined]
        except (SafetensorError, OSError) as e:  # a header our check let through
            raise WeightError(f"{info.file}: cannot read tensor '{name}' ({e})") from None
        self.read_seconds += time.perf_counter() - started
        self.bytes_read += tensor.numel() * tensor.element_size()
        self._whole_bytes += tensor.numel() * tensor.element_size()
        self._whole_calls += 1
        return tensor

    def _read_runs(
        self, info: TensorInfo, dim: int, runs: list[tuple[int, int]], device: torch.device
    ) -> torch.Tensor:
        """Indices [a, b) of each run along `dim`, read with positioned reads into the result
        on `device`: only their bytes come from the file (whole rows for columns in narrow
        runs, gathered where the result lives). A GPU's bytes go through the reader's reused
        pinned buffers and asynchronous copies (engine/staged_reads.py). (safetensors' own
        slices read the whole tensor first, as of 0.8. Copying out of a memory map instead
        took 5x the whole load's time on a 2xH100 host: 8,000 small clones and a
        concatenation per rank, issue 33.)"""
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        item = info.dtype.itemsize
        width = sum(b - a for a, b in runs)
        if dim == 0:
            row = item
            for d in info.shape[1:]:
                row *= d
            result = torch.empty((width, *info.shape[1:]), dtype=info.dtype, device=device)
            # (offset in the file, bytes): one read per run
            spans = [(info.offset + a * row, (b - a) * row) for a, b in runs]
        else:
            rows, cols = info.shape
            result = torch.empty((rows, width), dtype=info.dtype, device=device)
            if len(runs) > 1 and width * item < len(runs) * _PAGE:
                # Columns in runs narrower than a page on average (a TP rank's gate/up
                # columns come in 128-column blocks, 512 bytes a row): a read per row and
                # run would touch every page of the rows anyway, in millions of calls (2.1
                # million for an 8B rank, 6.3 s on a 2xH100 host). Whole rows, gathered.
                columns = torch.cat([torch.arange(a, b) for a, b in runs])
                self.reader.gather_columns(fd, info.offset, result, columns, cols)
                return result
            spans = [
                (info.offset + (r * cols + a) * item, (b - a) * item)
                for r in range(rows)
                for a, b in runs
            ]
        self.reader.read_into(fd, result, spans)
        return result

    @property
    def file_bytes(self) -> int:
        """Bytes brought in from the files so far (whole tensors, parts, whole rows and the
        gaps read through included)."""
        return self._whole_bytes + self.reader.file_bytes

    @property
    def read_calls(self) -> int:
        return self._whole_calls + self.reader.read_calls

    def close(self) -> None:
        """Let go of the files and the reader's buffers (a store is used by one thread at a
        time)."""
        self.reader.close()
        self._handles.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:  # a load that failed midway never reached close()
        try:
            self.close()
        except (OSError, AttributeError):  # half-built, or the interpreter is exiting
            pass


_PAGE = 4096  # bytes: the least a read from disk brings in


def _check_weight_dtype(name: str, info: TensorInfo, dtype: torch.dtype | None) -> None:
    """A weight (`dtype` given) must be stored in a floating-point type."""
    if dtype is not None and not info.dtype.is_floating_point:
        raise WeightError(
            f"tensor '{name}' in {info.file.name} has dtype "
            f"{str(info.dtype).removeprefix('torch.')}, the model expects a floating-point "
            "weight (float16, bfloat16 or float32)"
        )


def _placed(
    name: str,
    info: TensorInfo,
    tensor: torch.Tensor,
    dtype: torch.dtype | None,
    device: torch.device | str,
) -> torch.Tensor:
    """`tensor` read from the file, on `device`; with `dtype` a weight: cast, and refused if
    not finite (a NaN or inf weight turns every logit it reaches into NaN)."""
    if dtype is None:
        moved: torch.Tensor = tensor.to(device)
        return moved
    cast: torch.Tensor = tensor.to(device=device, dtype=dtype)
    if not bool(torch.isfinite(cast).all()):
        raise WeightError(_not_finite(name, info, tensor, cast))
    return cast


def _not_finite(name: str, info: TensorInfo, stored: torch.Tensor, cast: torch.Tensor) -> str:
    bad = int((~torch.isfinite(cast)).sum())
    where = f"tensor '{name}' in {info.file.name}"
    if bool(torch.isfinite(stored).all()):  # finite on disk: the cast overflowed
        return (
            f"{where} has {bad} values beyond the range of {str(cast.dtype).removeprefix('torch.')}"
            f" (largest magnitude {stored.abs().max().item():.4g}); load it with "
            "dtype='bfloat16' or 'float32'"
        )
    return f"{where} holds {bad} NaN or infinite values of {cast.numel()}: the file is corrupt"


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
        except ValueError as e:  # UnicodeDecodeError is one
            raise WeightError(f"{file}: corrupt safetensors header ({e})") from e
        except RecursionError:  # JSON nested deeper than the interpreter's recursion limit
            raise WeightError(
                f"{file}: corrupt safetensors header (JSON nested too deeply)"
            ) from None
    if not isinstance(header, dict):
        raise WeightError(
            f"{file}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)"
        )
    data_size = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise WeightError(f"{file}: tensor '{name}' has an unreadable header entry {entry!r}")
        if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in _DTYPES:
            raise WeightError(
                f"{file}: tensor '{name}' has dtype {entry.get('dtype')!r}, which Kestrel "
                f"does not read (known: {', '.join(_DTYPES)})"
            )
        dtype, itemsize = _DTYPES[entry["dtype"]]
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
            raise WeightError(
                f"{file}: tensor '{name}' has an unreadable header entry (shape {shape!r}, "
                f"data_offsets {offsets!r}: expected non-negative integers)"
            )
        shape, (start, end) = tuple(shape), offsets
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
        offset = 8 + header_len + start
        tensors[name] = TensorInfo(file=file, dtype=dtype, shape=shape, offset=offset)
    return tensors


def _naturals(values: object) -> TypeGuard[list[int]]:
    """A list of non-negative ints (JSON bools and floats are not sizes)."""
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    )
