"""The name a command's usage and errors show: the console script the user typed
(`kestrel`, `kestrel-ui`, ...: setup.sh installs them) or else the `python ...` form."""

from __future__ import annotations

import os
import sys


def program_name(python_form: str) -> str:
    """`kestrel-ui` when run as that script, else `python_form` (e.g. "python ui.py")."""
    typed = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return typed if typed.startswith("kestrel") else python_form
