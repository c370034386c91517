"""Process-wide state shared by ui.py, its tabs and the extensions (TGW's `modules.shared`).

Each request (a UI page's reply, an API request) brings its own stop, so stopping one front
end's work never ends another's. The one wider stop is TGW's `stop_everything`, which TGW
extensions set to end the UI's generation: it stops every reply of the UI (through
`stop_all_replies`, which ui.py points at its AppContext) and never an API request.

ui.py fills these in at start-up, before any extension's `setup()` runs. Extensions read
the current model through `manager` (never by keeping their own reference: the user may
load another model at any time) and the command-line flags through `args`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loader.manager import ModelManager

# The one current model (see loader/manager.py); replaced only by ui.py's start-up.
manager: ModelManager = ModelManager(Path("models"), Path("loras"))
# The parsed command line of ui.py (TGW-style flags); a default Namespace until then.
args: argparse.Namespace = argparse.Namespace()
# UI settings: the generation parameters' current values (TGW state-key names), presets.
settings: dict[str, Any] = {}

# TGW's `shared.stop_everything` (serving/tgw_compat's modules.shared reads and writes this):
# True once an extension asked to stop everything, False again when the UI starts a reply.
stop_everything: bool = False


def _no_replies() -> None:
    """stop_all_replies before ui.py has built its UI: there is nothing to stop."""


# Stops every running reply of the UI; ui.py sets it to its AppContext.stop_all.
stop_all_replies: Callable[[], None] = _no_replies


def request_stop_everything() -> None:
    """TGW's `shared.stop_everything = True`: stop every reply of the UI."""
    global stop_everything
    stop_everything = True
    stop_all_replies()
