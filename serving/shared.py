"""Process-wide state shared by ui.py, its tabs and the extensions (TGW's `modules.shared`).

There is no process-wide stop here: each request (a UI page's reply, an API request) brings
its own stop, so stopping one front end's work never ends another's.

ui.py fills these in at start-up, before any extension's `setup()` runs. Extensions read
the current model through `manager` (never by keeping their own reference: the user may
load another model at any time) and the command-line flags through `args`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from loader.manager import ModelManager

# The one current model (see loader/manager.py); replaced only by ui.py's start-up.
manager: ModelManager = ModelManager(Path("models"), Path("loras"))
# The parsed command line of ui.py (TGW-style flags); a default Namespace until then.
args: argparse.Namespace = argparse.Namespace()
# UI settings: the generation parameters' current values (TGW state-key names), presets.
settings: dict[str, Any] = {}
