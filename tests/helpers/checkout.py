"""The checkout as a fresh clone has it, and what pyproject.toml installs: for the tests that
run the README's commands and the installs from a clean tree."""

from __future__ import annotations

import re
import shutil
import subprocess
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
