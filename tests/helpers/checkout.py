"""The checkout as a fresh clone has it, what pyproject.toml installs, and virtual
environments to install it into: for the tests that run the README's commands and the
installs from a clean tree.

A scratch environment is layered over the one running the tests (a .pth file names that
one's site-packages, whose own .pth files are then not read), so installing into it is quick
and offline: no build isolation, no index, no dependencies."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_checkout(target: Path) -> Path:
    """Copy the committed and to-be-committed files (git's view: no build output, caches or
    virtual environment) into `target`; returns it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a deleted-but-tracked file is not in a fresh clone
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: command name -> "module:function"."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("\n[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', section, re.M))


def layered_venv(path: Path) -> Path:
    """A virtual environment at `path` that sees this one's packages, with this one's
    commands (torchrun, hf, ...) linked into its bin/; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "_kestrel_test_base.pth").write_text("\n".join(site.getsitepackages()))
    for command in (Path(sys.prefix) / "bin").iterdir():
        if not (path / "bin" / command.name).exists() and command.name != "activate":
            (path / "bin" / command.name).symlink_to(command)
    return python


def clean_env() -> dict[str, str]:
    """This process's environment without what would point Python elsewhere."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def pip_offline(python: Path, *args: str) -> None:
    """`pip ARGS` in the environment of `python`, offline and without dependencies."""
    result = subprocess.run(
        [python, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet"],
        capture_output=True, text=True, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
