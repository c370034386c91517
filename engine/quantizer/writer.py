"""Assembling the converted model: safetensors shards, config.json, tokenizer files.

    write_output(job_dir / "final", tensors, source_dir, quantization_config)
    publish(job_dir / "final", out_dir)     # one rename; OUT is complete or absent

Contract:
- Tensors are written as exllamav2's compiler names them: `output.safetensors`, or
  `output-0000N-of-0000M.safetensors` when they exceed `shard_bytes` (8 GiB by default),
  with tensors kept whole and in name order.
- config.json is the source's, with `quantization_config` set, `torch_dtype` float16,
  and the RoPE base written both ways (top-level `rope_theta` for exllamav2 and older
  readers, `rope_parameters` for transformers 5), since each reader sees only its own.
- Every other non-weight file of the source (tokenizer, chat template, generation config)
  is copied unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine.quantizer.job import atomic_save_tensors

SHARD_BYTES = 8 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def write_output(
    final_dir: Path,
    tensors: Mapping[str, torch.Tensor],
    source_dir: Path,
    quantization_config: dict[str, Any],
    *,
    shard_bytes: int = SHARD_BYTES,
) -> list[Path]:
    if final_dir.exists():
        shutil.rmtree(final_dir)
    final_dir.mkdir(parents=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = []
    for i, names in enumerate(shards):
        fname = (
            "output.safetensors"
            if len(shards) == 1
            else f"output-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        atomic_save_tensors(final_dir / fname, {n: tensors[n] for n in names})
        files.append(final_dir / fname)
    write_config(final_dir, source_dir, quantization_config)
    copy_side_files(source_dir, final_dir)
    return files


def write_config(final_dir: Path, source_dir: Path, quantization_config: dict[str, Any]) -> None:
    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    target = config.get("text_config") if "hidden_size" not in config else config
    if isinstance(target, dict):
        _write_rope_both_ways(target)
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = "float16"
    if "dtype" in config:
        config["dtype"] = "float16"
    (final_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _write_rope_both_ways(config: dict[str, Any]) -> None:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type parameters (Gemma 3): the full-attention base is the model's base.
        main = params.get("full_attention", next(iter(params.values())))
        if "rope_theta" not in config and "rope_theta" in main:
            config["rope_theta"] = main["rope_theta"]
        return
    if isinstance(params, dict) and "rope_theta" in params:
        config.setdefault("rope_theta", params["rope_theta"])
        return
    theta = config.get("rope_theta", 10000.0)
    config["rope_theta"] = theta
    scaling = config.get("rope_scaling")
    merged: dict[str, Any] = dict(scaling) if isinstance(scaling, dict) else {}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    merged.setdefault("rope_type", "default")
    merged["rope_theta"] = theta
    config["rope_parameters"] = merged


def copy_side_files(source_dir: Path, final_dir: Path) -> None:
    for path in sorted(source_dir.iterdir()):
        if not path.is_file() or path.name in _SKIP_FILES or path.name.startswith("."):
            continue
        if path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(path, final_dir / path.name)


def publish(final_dir: Path, out_dir: Path) -> None:
    """Move the finished output into place with one rename (an empty OUT is replaced)."""
    if out_dir.exists():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            raise FileExistsError(f"output directory {out_dir} appeared while converting")
    os.replace(final_dir, out_dir)
