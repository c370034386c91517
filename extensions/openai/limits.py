"""A cap on the size of request bodies (ASGI middleware).

Without one the server reads whatever a client sends into memory before any check runs.
The cap sits far above any real request (a full 128k-token prompt as text or as a list of
token ids is a few MB); a body over it is a 413 with an OpenAI-style error. Bodies that
announce their length are refused before they are read; chunked ones once they pass it.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from extensions.openai.errors import ApiError

DEFAULT_MAX_BODY_BYTES = 32 * 2**20


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes ({limit / 2**20:g} MiB), the limit"


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            response = ApiError(413, _too_large(self.max_bytes), code="request_too_large")
            await response.response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises an HTTPException from the body read as it is; the
                    # app's handler turns it into the OpenAI-style 413.
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, counted, send)
