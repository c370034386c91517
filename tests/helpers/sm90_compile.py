"""Compile a kernel for sm_90 without a GPU and read what the generated code holds.

The suite runs its kernels through the Triton interpreter (TRITON_INTERPRET=1), which has no
compiler; a child process without that variable compiles with Triton's bundled ptxas and
prints one JSON line about the PTX. Tests count instructions there, never time them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compiled_facts(script: str, *args: str, what: str) -> dict[str, Any]:
    """Run `script` (Python that compiles a kernel and prints a JSON line last) in a child
    process at the repository root, outside the interpreter, with `args`; the JSON it
    printed. A failed compile fails the test, naming `what` and the child's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"sm_90 compile of {what} failed:\n{done.stderr[-2000:]}")
    facts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return facts
