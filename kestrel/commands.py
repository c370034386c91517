"""The front ends' console scripts.

`bash setup.sh` installs the checkout in editable mode, so its root (ui.py, convert.py,
extensions/, webui/, serving/) is importable wherever the script runs. `pip install
/path/to/kestrel` (text-generation-webui's environment) installs the engine's packages only:
there these commands say so instead of failing with a traceback. The front ends are imported
when called, so that a script loads only what its command needs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# The modules each front end needs beyond the engine's packages: their absence means an
# engine-only install, not a broken one.
_CHECKOUT_ONLY = {"ui", "convert", "extensions", "webui", "serving"}


def _run(command: str, module: str, what: str) -> int:
    try:
        main: Callable[[list[str] | None], int] = importlib.import_module(module).main
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in _CHECKOUT_ONLY:
            raise  # a missing dependency: its own message says which
        print(
            f"{command}: {what} runs from a Kestrel checkout, and this Python has Kestrel's "
            f"engine only (as `pip install /path/to/kestrel` installs it for "
            f"text-generation-webui). In a checkout: `bash setup.sh`, then .venv/bin/{command}",
            file=sys.stderr,
        )
        return 2
    return main(None)


def ui() -> int:
    """kestrel-ui: the web UI (ui.py)."""
    return _run("kestrel-ui", "ui", "the web UI")


def api() -> int:
    """kestrel-api: the OpenAI-compatible API alone (python -m extensions.openai)."""
    return _run("kestrel-api", "extensions.openai.__main__", "the OpenAI-compatible API")


def convert() -> int:
    """kestrel-convert: the EXL2 quantizer's command line (convert.py)."""
    return _run("kestrel-convert", "convert", "the quantizer's command line")
