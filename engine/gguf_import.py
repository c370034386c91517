"""Import a GGUF file as a Hugging Face model directory (safetensors + config + tokenizer).

    from engine.gguf_import import import_gguf
    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/SmolLM2-135M-Instruct-fp16")

    python -m engine.gguf_import FILE.gguf OUT_DIR [--dtype float16] [--overwrite]

Contract:
- The GGUF is read through transformers' GGUF loader (packages `gguf` and `accelerate`),
  which dequantizes every tensor; the result is one `model.safetensors` in `dtype`
  (float16 by default; bfloat16 instead if a weight would overflow float16), with
  `config.json`, `generation_config.json` where the model has one, and the tokenizer
  (`tokenizer.json`, `tokenizer_config.json`, the chat template; a Gemma GGUF's
  `tokenizer.json` is Kestrel's own, engine/gguf_tokenizer.py, since transformers before
  5.2x builds a wrong one). Kestrel and transformers
  load it as any FP16 checkpoint; the config also carries the keys exllamav2 reads.
- Atomic: everything is written into `.<name>.partial-<pid>` beside `out_dir` and renamed
  into place at the end; on any error (or Ctrl-C) that directory is removed and `out_dir`
  is untouched. With `overwrite=True` the old `out_dir` is removed just before the rename.
- Errors name the file: a missing file or directory as `FileNotFoundError`, a file that is
  not GGUF or an architecture transformers cannot import as `GGUFImportError` (a
  `ValueError`), a non-empty `out_dir` as `FileExistsError` unless `overwrite=True`.
- Progress goes to stderr: stage lines when `progress` is true; transformers draws its own
  bars while it dequantizes either way.
- gguf's `GGUFReader` parses metadata arrays one element at a time (tens of seconds for a
  262k-token vocabulary such as Gemma 3's, and transformers parses the file three times:
  config, tokenizer, weights). While `_convert` runs, `gguf.GGUFReader` is replaced by
  `FastGGUFReader`, which reads the same fields with the same parts and indices but parses
  arrays in bulk (41 s -> 1.4 s for gemma-3-270m). The swap is process-wide for that time:
  do not read GGUF files from other threads during an import.
- Time on a shared 2-core CPU: SmolLM2-135M (49k vocabulary) 22-27 s (41 s with the stock
  reader), Gemma 3 270M (262k vocabulary, Q4_K_M) 41-57 s (189 s), mostly transformers
  converting the tokenizer, mapping tensor names and dequantizing with numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from engine.gguf_tokenizer import write_gguf_tokenizer

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
    _check_gguf_layout(path)


def _check_gguf_layout(path: Path) -> None:
    """Header readable and every tensor's bytes inside the file: a truncated download is
    named as such here, not as a reshape error deep inside transformers."""
    try:
        import gguf  # noqa: F401  (without it, _require_packages names what to install)
    except ImportError:
        return
    try:
        reader = fast_gguf_reader_class()(str(path))
    except Exception as e:  # the reader raises struct, numpy and unicode errors alike
        raise GGUFImportError(
            f"{path}: unreadable GGUF file, truncated or corrupt ({type(e).__name__}: {e})"
        ) from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise GGUFImportError(
                f"{path} is truncated: tensor '{tensor.name}' ends at byte {end}, "
                f"the file has {size}"
            )


def gguf_architecture(path: str | Path) -> str | None:
    """`general.architecture` from the file's metadata, or None where it cannot be read."""
    try:
        field = fast_gguf_reader_class()(str(path)).fields.get("general.architecture")
        if field is None:
            return None
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception:  # a best-effort detail for an error message, never an error itself
        return None


@cache
def fast_gguf_reader_class() -> type:
    """`gguf.GGUFReader` with arrays parsed in bulk; the stock reader where that is unsafe.

    The subclass yields exactly the stock reader's fields (same `parts`, `data` indices and
    `types`; tests/engine/test_gguf_import.py compares them), so transformers reads it unchanged.
    The stock `_get_field_parts` makes a few numpy views per array element; this one reads a
    scalar array with one numpy call and walks a string array with `struct`. Nested arrays,
    empty arrays and scalar fields go to the stock code. If the installed gguf lacks the
    internals it relies on, the stock class is returned.
    """
    from gguf import GGUFReader, GGUFValueType

    if not all(
        hasattr(GGUFReader, name) for name in ("_get", "_get_field_parts", "gguf_scalar_to_np")
    ):
        return GGUFReader

    class FastGGUFReader(GGUFReader):
        def _get_field_parts(
            self, orig_offs: int, raw_type: int
        ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            count = int(alen[0])
            item_type = GGUFValueType(int(raw_itype[0]))
            types = [GGUFValueType.ARRAY, item_type]
            offs = orig_offs + int(raw_itype.nbytes + alen.nbytes)
            parts: list[np.ndarray] = [raw_itype, alen]
            scalar = self.gguf_scalar_to_np.get(item_type)
            if count and scalar is not None:
                values = np.array(self._get(offs, scalar, count))  # keeps the byte order
                parts += list(values.reshape(count, 1))
                return offs + values.nbytes - orig_offs, parts, list(range(2, 2 + count)), types
            if count and item_type == GGUFValueType.STRING:
                raw = self.data.view(np.ndarray)  # a plain view: memmap slicing is slow
                size_type = np.dtype(np.uint64).newbyteorder(self.byte_order)
                swapped = ">" if sys.byteorder == "little" else "<"
                unpack = struct.Struct("=Q" if self.byte_order == "I" else f"{swapped}Q")
                buffer = raw.data  # the same bytes, as a memoryview
                for _ in range(count):
                    (length,) = unpack.unpack_from(buffer, offs)
                    parts.append(raw[offs : offs + 8].view(size_type))
                    parts.append(raw[offs + 8 : offs + 8 + length])
                    offs += 8 + length
                return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), types
            return super()._get_field_parts(orig_offs, raw_type)

    return FastGGUFReader


@contextmanager
def _fast_gguf_reader() -> Iterator[None]:
    # transformers runs `from gguf import GGUFReader` inside each call, so swapping the
    # module attribute reaches all three of its reads.
    import gguf

    stock = gguf.GGUFReader
    # A module attribute swapped in place: its declared type is the stock class.
    gguf.GGUFReader = fast_gguf_reader_class()  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = stock  # type: ignore[misc]


@contextmanager
def _elapsed_until_the_bar(progress: bool, label: str) -> Iterator[None]:
    """transformers parses the GGUF metadata and builds the model before its per-tensor bar
    appears: 15 s with nothing on screen on a busy 2-core CPU. A ticking line shows that
    stage's elapsed time and gives way when transformers' bar starts (its module's `tqdm`
    is wrapped for that while; without that name the ticker just runs to the end)."""
    if not progress:
        yield
        return
    import threading

    from tqdm.auto import tqdm

    gguf_utils: ModuleType | None
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    ticker = tqdm(desc=f"[gguf import] {label}", bar_format="{desc}: {elapsed}", file=sys.stderr)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            ticker.refresh()

    def end() -> None:
        if not stop.is_set():
            stop.set()
            thread.join()
            ticker.close()

    stock = getattr(gguf_utils, "tqdm", None)

    def bar(*args: Any, **kwargs: Any) -> Any:
        end()
        return stock(*args, **kwargs)  # type: ignore[misc]

    thread = threading.Thread(target=tick, name="gguf-import-ticker", daemon=True)
    thread.start()
    # transformers' module imports tqdm without exporting it: hence the ignores.
    if gguf_utils is not None and stock is not None:
        gguf_utils.tqdm = bar  # type: ignore[attr-defined]
    try:
        yield
    finally:
        end()
        if gguf_utils is not None and stock is not None:
            gguf_utils.tqdm = stock  # type: ignore[attr-defined]


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
        with _fast_gguf_reader():
            # trust_remote_code=False: never run (or ask to run) code from the folder.
            tokenizer = AutoTokenizer.from_pretrained(
                where, gguf_file=name, trust_remote_code=False
            )
            _say(progress, "dequantizing the weights (transformers)")
            # float32 so that nothing is lost before the one cast below.
            with _elapsed_until_the_bar(progress, "reading the GGUF metadata, building the model"):
                model = AutoModelForCausalLM.from_pretrained(
                    where,
                    gguf_file=name,
                    dtype=torch.float32,
                    trust_remote_code=False,
                    **_dequantize_option(),
                )
    except Exception as e:  # a damaged file fails in many ways inside gguf and transformers
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
    if write_gguf_tokenizer(fast_gguf_reader_class()(str(gguf_path)), out):
        _say(progress, "wrote the tokenizer from the GGUF's vocabulary (engine/gguf_tokenizer.py)")
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
        from transformers import GgufConfig
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
