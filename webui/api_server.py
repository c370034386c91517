"""Starting the OpenAI-compatible API (extensions/openai) from ui.py's --api flags.

The API serves the same current model as the UI (serving.shared.manager). It binds where the
UI does: 127.0.0.1 unless --listen.
"""

from __future__ import annotations

import argparse
import sys

from webui import cli


def start_api(args: argparse.Namespace, *, block: bool) -> bool:
    """Start the API on --api-port; with `block` (--nowebui) serve until interrupted.
    Returns False, having said why on stderr, when it could not start (a port in use): the
    web UI still starts."""
    from extensions.openai import run_api_server

    host = cli.host(args)
    if not block:
        print(f"[kestrel ui] OpenAI-compatible API on http://{host}:{args.api_port}/v1",
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        origins = [o.strip() for o in getattr(args, "cors_origins", "").split(",") if o.strip()]
        run_api_server(
            host, args.api_port, args.api_key, args.admin_key, block, cors_origins=origins
        )
    except Exception as e:
        print(f"[kestrel ui] the API did not start: {e}", file=sys.stderr, flush=True)
        return False
    return True
