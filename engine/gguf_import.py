"""Import a GGUF file as a Hugging Face model directory (safetensors + config + tokenizer).

    from engine.gguf_import import import_gguf
    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/SmolLM2-135M-Instruct-fp16")

    python -m engine.gguf_import FILE.gguf OUT_DIR [--dtype float16] [--overwrite]

Contract:
- The GGUF is read through transformers' GGUF loader (packages `gguf` and `accelerate`),
  which dequantizes every tensor; the result is one `model.safetensors` in `dtype`
  (float16 by default; bfloat16 instead if a weight would overflow float16), with
  `config.json`, `generation_config.json` where the model has one, and the tokenizer
  (`tokenizer.json`, `tokenizer_config.json`, the chat template). Kestrel and transformers
  load it as any FP16 checkpoint; the config also carries the keys exllamav2 reads.
- Atomic: everything is written into `.<name>.partial-<pid>` beside `out_dir` and renamed
  into place at the end; on any error (or Ctrl-C) that directory is removed and `out_dir`
  is untouched. With `overwrite=True` the old `out_dir` is removed just before the rename.
- Errors name the file: a missing file or directory as `FileNotFoundError`, a file that is
  not GGUF or an architecture transformers cannot import as `GGUFImportError` (a
  `ValueError`), a non-empty `out_dir` as `FileExistsError` unless `overwrite=True`.
- Progress goes to stderr: stage lines when `progress` is true; transformers draws its own
  bars while it dequantizes either way.
- Takes about 40 s for SmolLM2-135M on a 2-core CPU, mostly transformers parsing the GGUF
  metadata (it reads the file three times); the dequantization itself is a few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

GGUF_MAGIC = b"GGUF"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# An imported directory has all of these. It appears (by rename) only once complete, so a
# directory that has them is a finished import; callers use this to skip a second import.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported (not GGUF, unsupported architecture, bad metadata)."""


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Convert `gguf_path` into an HF model directory at `out_dir`; returns `out_dir`."""
    gguf_path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    _check_gguf_file(gguf_path)
    if out_dir.exists():
        if not out_dir.is_dir():
            raise FileExistsError(f"output path exists and is not a directory: {out_dir}")
        if any(out_dir.iterdir()) and not overwrite:
            raise FileExistsError(
                f"output directory is not empty: {out_dir} (pass overwrite=True / --overwrite)"
            )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if partial.exists():  # left by an earlier crash of a process with the same pid
        shutil.rmtree(partial)
    started = time.perf_counter()
    try:
        partial.mkdir()
        _convert(gguf_path, partial, DTYPES[dtype], progress)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _say(
        progress, f"imported {gguf_path.name} → {out_dir} in {time.perf_counter() - started:.0f} s"
    )
    return out_dir


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[gguf import] {message}", file=sys.stderr, flush=True)


def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise GGUFImportError(f"not a file: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
        )


def gguf_architecture(path: str | Path) -> str | None:
    """`general.architecture` from the file's metadata, or None where it cannot be read."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("general.architecture")
        if field is None:
            return None
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception:  # a best-effort detail for an error message, never an error itself
        return None


def _require_packages() -> None:
    missing = []
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise GGUFImportError(
            f"importing GGUF needs the package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)}"
        )


def _convert(gguf_path: Path, out: Path, dtype: torch.dtype, progress: bool) -> None:
    _require_packages()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    _say(progress, f"reading the tokenizer of {gguf_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        _say(progress, "dequantizing the weights (transformers)")
        # float32 so that nothing is lost before the one cast below.
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, **_dequantize_option()
        )
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        arch = gguf_architecture(gguf_path)
        what = f"architecture '{arch}'" if arch else "a model"
        raise GGUFImportError(
            f"transformers cannot import {gguf_path} ({what}): {type(e).__name__}: {e}"
        ) from e

    _say(progress, f"writing {type(model).__name__} weights")
    state = model.state_dict()
    not_float = [k for k, t in state.items() if not t.is_floating_point()]
    if not_float:  # a transformers that keeps GGUF blocks packed would give uint8 here
        raise GGUFImportError(
            f"{gguf_path}: transformers left {len(not_float)} tensors quantized "
            f"(e.g. {not_float[0]}); cannot write a float checkpoint"
        )
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embeddings; HF omits it too
    dtype = _safe_dtype(state, dtype, progress)
    tensors = {k: t.detach().to(dtype).contiguous() for k, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors, state

    tokenizer.save_pretrained(out)
    if model.generation_config is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
    model.config.save_pretrained(out)
    _fix_config(out / "config.json", architecture=type(model).__name__, dtype=dtype)
    # safetensors creates its file owner-only (0600); give it the mode the other files got
    # from the umask, so a shared models/ directory stays readable.
    shutil.copymode(out / "config.json", out / "model.safetensors")


def _dequantize_option() -> dict[str, Any]:
    # Newer transformers can keep GGUF blocks packed (GgufLinear) when a matmul kernel exists;
    # a checkpoint needs plain float tensors, so ask for the dequantized model explicitly.
    try:
        from transformers import GgufConfig  # type: ignore[attr-defined]
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _safe_dtype(state: dict[str, torch.Tensor], dtype: torch.dtype, progress: bool) -> torch.dtype:
    if dtype != torch.float16:
        return dtype
    limit = torch.finfo(torch.float16).max
    for name, tensor in state.items():
        if tensor.abs().max().item() > limit:
            _say(progress, f"{name} overflows float16; writing bfloat16 instead")
            return torch.bfloat16
    return dtype


def _fix_config(path: Path, *, architecture: str, dtype: torch.dtype) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    # The GGUF quantization config describes the source file, not these float weights:
    # loaders would take the directory for a quantized model.
    config.pop("quantization_config", None)
    # transformers builds the config from GGUF metadata without `architectures`, which
    # Kestrel and exllamav2 use to pick the model class.
    config["architectures"] = [architecture]
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name
    config["torch_dtype"] = dtype_name  # transformers 4 and exllamav2 read the old name
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]  # exllamav2 reads only the top-level key
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.gguf_import",
        description="Convert a GGUF file into a Hugging Face model directory (FP16 safetensors).",
    )
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out_dir", help="directory to create")
    parser.add_argument("--dtype", default="float16", choices=list(DTYPES))
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    args = parser.parse_args(argv)
    try:
        import_gguf(args.gguf, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
