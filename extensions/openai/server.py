"""Running the API: uvicorn in a background thread (or the calling one).

    server = run_api_server("127.0.0.1", 5000, api_key=None, admin_key=None, block=False)
    server.url            # "http://127.0.0.1:5000" (port 0 picks a free port)
    server.stop()

ui.py (`--api`, `--nowebui`), the openai extension's setup() and `python -m
extensions.openai` all start the API through `run_api_server`. The model comes from
serving.shared.manager unless a manager is given.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import uvicorn

from extensions.openai.app import LOOPBACK_HOSTS, create_app
from loader.manager import ModelManager
from serving import shared

log = logging.getLogger(__name__)


SHUTDOWN_GRACE_SECONDS = 3


def warn_open(host: str, api_key: str | None, admin_key: str | None) -> None:
    """Say loudly (log and stderr) what a server on a network address lets anyone do."""
    if api_key:
        return
    admin = (
        "admin routes need the admin key"
        if admin_key
        else "admin routes (model/LoRA loading) are refused from other hosts until "
        "--admin-key is set"
    )
    message = (
        f"WARNING: the API listens on {host} with no --api-key: anyone who can reach this "
        f"machine can generate with the loaded model; {admin}. Set --api-key."
    )
    log.warning(message)
    print(message, file=sys.stderr, flush=True)


class ApiServerError(RuntimeError):
    """The server could not start (e.g. the port is taken)."""


@dataclass
class ApiServer:
    server: uvicorn.Server
    thread: threading.Thread | None
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)


def run_api_server(
    host: str = "127.0.0.1",
    port: int = 5000,
    api_key: str | None = None,
    admin_key: str | None = None,
    block: bool = False,
    *,
    manager: ModelManager | None = None,
    cors_origins: Sequence[str] = (),
    log_level: str = "warning",
    start_timeout: float = 30.0,
) -> ApiServer:
    """Serve the API on host:port. `block=True` serves in this thread until interrupted;
    otherwise a daemon thread serves and this returns once the socket listens."""
    app = create_app(
        manager or shared.manager,
        api_key=api_key or None,
        admin_key=admin_key or None,
        cors_origins=cors_origins,
        local_only=host in LOOPBACK_HOSTS,
    )
    if host not in LOOPBACK_HOSTS:
        warn_open(host, api_key, admin_key)
    # A request still in flight at shutdown (a long render, a stream) must not keep the
    # process alive after the first SIGTERM / Ctrl+C: uvicorn cancels it after this long.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )
    server = uvicorn.Server(config)
    if block:
        log.warning("OpenAI-compatible API on http://%s:%d/v1", host, port)
        server.run()
        return ApiServer(server, None, host, port)

    def serve() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn exits when it cannot bind; reported below
            pass

    thread = threading.Thread(target=serve, name="kestrel-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive():
            raise ApiServerError(f"the API server could not start on {host}:{port} (see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise ApiServerError(f"the API server did not start on {host}:{port} in time")
        time.sleep(0.02)
    bound = port
    for listener in server.servers:
        for sock in listener.sockets:
            bound = sock.getsockname()[1]
    running = ApiServer(server, thread, host, bound)
    log.warning("OpenAI-compatible API on %s/v1", running.url)
    return running
