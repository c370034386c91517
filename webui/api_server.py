"""Starting the OpenAI-compatible API (extensions/openai) from ui.py's --api flags.

The API serves the same current model as the UI (webui.shared.manager). It binds where the
UI does: 127.0.0.1 unless --listen.
"""

from __future__ import annotations

import argparse

from webui import cli


def start_api(args: argparse.Namespace, *, block: bool) -> None:
    """Start the API on --api-port; with `block` (--nowebui) serve until interrupted."""
    from extensions.openai import run_api_server

    run_api_server(cli.host(args), args.api_port, args.api_key, args.admin_key, block)
