"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

`ApiError` is raised by the handlers; `error_for(exception)` maps Kestrel's own exceptions
(context too long, bad sampling settings, no model, a feature a loader lacks, ...) to the
status and type an OpenAI client expects, so that no request can crash the server.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loader.base import LoaderError, UnsupportedFeatureError
from loader.errors import (
    CacheFullError,
    ChatTemplateError,
    ContextLengthError,
    EmptyPromptError,
    GenerationMemoryError,
    KestrelError,
    LoraError,
    QueueFullError,
    SamplingSettingsError,
    SchedulerError,
)
from loader.manager import ModelNotLoadedError, ModelPinnedError, UnknownNameError

log = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 1000


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE_CHARS:  # values are echoed: a 1 MB prompt must not be
            cut = len(message) - MAX_MESSAGE_CHARS
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more characters)"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_for(error: BaseException, prompt_param: str = "messages") -> ApiError:
    """The API error for an exception raised while serving a request; `prompt_param` is
    the body field a prompt problem is reported under ("prompt" or "messages")."""
    if isinstance(error, ApiError):
        return error
    message = str(error) or type(error).__name__
    if isinstance(error, EmptyPromptError):
        return ApiError(400, message, param=prompt_param, code="empty_prompt")
    if isinstance(error, ModelNotLoadedError):
        return ApiError(
            503, f"{message}: load one first", type="server_error", code="model_not_loaded"
        )
    if isinstance(error, ModelPinnedError):  # before LoaderError's 400: the request is fine
        return ApiError(409, message, param="model_name", code="model_pinned")
    if isinstance(error, UnknownNameError):
        return ApiError(404, message, param="model_name", code="model_not_found")
    if isinstance(error, UnsupportedFeatureError):
        return ApiError(501, message, type="not_implemented_error", code="unsupported")
    if isinstance(error, ContextLengthError | CacheFullError):
        return ApiError(400, message, param=prompt_param, code="context_length_exceeded")
    if isinstance(error, SamplingSettingsError):
        return ApiError(400, message, param=error.param)
    if isinstance(error, ChatTemplateError):
        return ApiError(400, message, param="messages", code="chat_template_error")
    if isinstance(error, GenerationMemoryError):
        return ApiError(503, message, type="server_error", code="out_of_memory")
    if isinstance(error, LoraError):
        return ApiError(400, message, param="loras")
    if isinstance(error, QueueFullError):
        return ApiError(429, message, type="server_error", code="queue_full")
    if isinstance(error, SchedulerError):  # the model was unloaded under the request
        return ApiError(503, message, type="server_error", code="model_unloaded")
    if isinstance(error, KestrelError):  # any other error the request's input caused
        return ApiError(400, message, param=error.param)
    if isinstance(error, LoaderError | ValueError):
        return ApiError(400, message)
    if isinstance(error, RecursionError):  # a value nested deeper than anything real
        return ApiError(400, f"a value in the request is nested too deeply ({message})")
    log.exception("request failed", exc_info=error)
    return ApiError(500, f"internal error: {type(error).__name__}: {message}", type="server_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or part.startswith("function-")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        while location and _is_type_tag(location[-1]):
            location.pop()  # pydantic names the union member tried ("prompt.str"): not a field
        if first.get("type") == "json_invalid":
            message = f"malformed JSON in the request body: {first.get('msg', '')}"
            return ApiError(400, message, code="invalid_json").response()
        param = ".".join(location) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if "input" in first and first.get("type") != "missing":
            message += f" (got {first['input']!r})"
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            bad = cause.object[cause.start : cause.start + 1]
            message = (
                f"the request body is not valid UTF-8: byte 0x{bad.hex()} at position "
                f"{cause.start} ({cause.reason}); send JSON encoded as UTF-8"
            )
            return ApiError(400, message, code="invalid_json").response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None  # extensions/openai/limits
        return ApiError(exc.status_code, str(exc.detail), type=kind, code=code).response()

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        return error_for(exc).response()
