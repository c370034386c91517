"""Request guards (one ASGI middleware): cross-site requests, admin routes reached from the
network without a key, and errors that would otherwise cost the client its connection.

- A state-changing request (any method but GET/HEAD/OPTIONS) whose `Origin` is not the
  server's own (nor a --cors-origins entry) is a 403: a web page the user visits could
  otherwise POST to /v1/internal/model/unload on localhost. Such requests must also send
  `application/json` (a 415 otherwise): the content types a page may send cross-site
  without a preflight (text/plain, forms) are refused even where no Origin is sent.
- Admin routes (/v1/internal/model/*, /v1/internal/lora/*) from a client that is not on
  loopback are a 403 unless an admin key (or the API key) is configured.
- An exception that no handler turned into a response becomes the OpenAI-style error of
  `error_for` here, before Starlette's ServerErrorMiddleware, which answers it too but then
  re-raises, and uvicorn drops the keep-alive connection that the client would reuse.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from extensions.openai.errors import ApiError, error_for

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
ADMIN_PREFIXES = ("/v1/internal/model/", "/v1/internal/lora/")
# Status routes under those prefixes that any API client may read.
ADMIN_EXEMPT = {"/v1/internal/model/info"}


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES) and path not in ADMIN_EXEMPT


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return address == "localhost"


def _origin_host(origin: str) -> str:
    """The host:port of an http(s) origin, as a Host header says it."""
    scheme, sep, rest = origin.partition("://")
    return rest.rstrip("/").lower() if sep and scheme in ("http", "https") else ""


def _default_port(host: str, scheme: str) -> str:
    if host.startswith("[") and "]:" not in host or not host.startswith("[") and ":" not in host:
        return f"{host}:{443 if scheme == 'https' else 80}"
    return host


class RequestGuard:
    def __init__(
        self, app: ASGIApp, *, cors_origins: Sequence[str] = (), admin_key_set: bool = False
    ) -> None:
        self.app = app
        self.cors_origins = {o.rstrip("/").lower() for o in cors_origins}
        self.admin_key_set = admin_key_set

    def refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope.get("headers") or [])
        method = scope.get("method", "GET")
        path = scope.get("path", "")
        if method not in SAFE_METHODS:
            origin = headers.get(b"origin", b"").decode("latin-1").strip()
            if origin and not self._same_origin(origin, headers, scope):
                return ApiError(
                    403,
                    f"cross-origin {method} from {origin[:200]!r} refused: only the server's own "
                    "origin (or one given to --cors-origins) may change state",
                    type="permission_error",
                    code="cross_origin",
                )
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0]
            kind = kind.strip().lower()
            if kind and kind != "application/json":
                return ApiError(
                    415,
                    f"content type {kind[:100]!r} refused: send the body as application/json",
                    code="unsupported_media_type",
                )
        if is_admin_path(path) and not self.admin_key_set:
            client = (scope.get("client") or ("", 0))[0] or ""
            if not _is_loopback(client):
                return ApiError(
                    403,
                    f"{path} is an admin route: from {client or 'an unknown address'} (not "
                    "loopback) it needs an admin key; start the server with --admin-key",
                    type="permission_error",
                    code="admin_key_required",
                )
        return None

    def _same_origin(self, origin: str, headers: dict[bytes, bytes], scope: Scope) -> bool:
        if origin.rstrip("/").lower() in self.cors_origins:
            return True
        scheme = origin.partition("://")[0]
        host = headers.get(b"host", b"").decode("latin-1").strip().lower()
        mine = _origin_host(origin)
        return bool(mine and host) and _default_port(mine, scheme) == _default_port(host, scheme)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope)
        if refused is not None:
            await refused.response()(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as error:
            if started:  # the status line is out: nothing to answer with but closing
                raise
            await error_for(error).response()(scope, receive, send)
