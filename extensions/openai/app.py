"""The FastAPI app: OpenAI endpoints plus TGW's /v1/internal admin endpoints.

    app = create_app(manager, api_key=None, admin_key=None, cors_origins=())

- GET /v1/models, /v1/models/{id}: the loaded model.
- POST /v1/completions, /v1/chat/completions (extensions/openai/generation.py).
- GET /v1/internal/health, /v1/internal/model/info.
- Admin (admin key; the API key when no admin key is set; with neither, loopback clients
  only): GET /v1/internal/model/list,
  POST /v1/internal/model/load {"model_name", "args": {loader options}, "loader"},
  POST /v1/internal/model/unload, GET /v1/internal/lora/list,
  POST /v1/internal/lora/load {"lora_names", "lora_weights"},
  POST /v1/internal/lora/unload {"lora_names"} (none: every loaded LoRA).

Names are entries of the manager's models/LoRA directories, never paths. Keys are
`Authorization: Bearer <key>`. With `local_only` (no --listen) requests must name a
loopback host, which stops DNS-rebinding pages from reaching the API. CORS is off unless
origins are given. Request bodies over `max_body_bytes` (32 MiB) are refused with a 413.
extensions/openai/guards.py refuses cross-site state changes and admin routes reached from
the network without a key. /openapi.json needs the API key too.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from extensions.openai import embeddings, generation
from extensions.openai.errors import ApiError, error_for, install_handlers
from extensions.openai.guards import RequestGuard
from extensions.openai.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from extensions.openai.load_defaults import with_cache_default
from extensions.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadModelRequest,
    LoraRequest,
)
from loader.base import LoadedModel
from loader.manager import ModelManager, ModelPinnedError, UnknownNameError

LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
RESERVED_LOAD_ARGS = {"self", "name", "loader_name", "progress"}
# Adapters are trained for scale 1; past this the activations overflow (1e308 made every
# request fail) and no use of a LoRA goes near it.
MAX_LORA_WEIGHT = 100.0


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _key_check(key: str | None, what: str) -> Callable[[Request], Awaitable[None]]:
    # async: FastAPI runs a plain function dependency in a worker thread, one per concurrent
    # request, which then idle for 10 s: a burst of requests left dozens behind.
    async def check(request: Request) -> None:
        if key and not hmac.compare_digest(_bearer(request).encode(), key.encode()):
            raise ApiError(
                401,
                f"invalid or missing {what}: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check


def _host_of(header: str) -> str:
    if header.startswith("["):  # [::1]:5000
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LoopbackOnly:
    """Refuses requests whose Host header is not a loopback name (DNS rebinding).

    A plain ASGI middleware: starlette's BaseHTTPMiddleware would wrap `receive` and hide
    client disconnects from the endpoints, which need them to cancel generation."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            host = _host_of(headers.get(b"host", b"").decode("latin-1"))
            if host not in LOOPBACK_HOSTS:
                response = ApiError(
                    403,
                    f"host {host!r} refused: the API listens on loopback only (use --listen)",
                    type="permission_error",
                ).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    manager: ModelManager,
    *,
    api_key: str | None = None,
    admin_key: str | None = None,
    cors_origins: Sequence[str] = (),
    local_only: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    # The schema is served below, behind the API key like every other route.
    app = FastAPI(
        title="Kestrel OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None
    )
    install_handlers(app)
    # Innermost first: the guard turns stray exceptions into responses before Starlette's
    # outermost error middleware (which would drop the connection after answering).
    app.add_middleware(
        RequestGuard, cors_origins=cors_origins, admin_key_set=bool(admin_key or api_key)
    )
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    if local_only:
        app.add_middleware(LoopbackOnly)

    user = [Depends(_key_check(api_key, "API key"))]
    admin = [Depends(_key_check(admin_key or api_key, "admin key"))]

    def current(requested: str | None) -> tuple[LoadedModel, str]:
        try:
            model = manager.current()
        except Exception as error:
            raise error_for(error) from error
        name = manager.name or model.path.name
        if requested and requested != name:
            raise ApiError(
                404,
                f"the model {requested[:200]!r} is not loaded (loaded: {name!r}); load it through "
                "/v1/internal/model/load with the admin key",
                param="model",
                code="model_not_found",
            )
        return model, name

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kestrel"}

    @app.get("/v1/models", dependencies=user)
    async def list_models() -> dict[str, Any]:
        data = [model_card(manager.name or "")] if manager.is_loaded() else []
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id}", dependencies=user)
    async def get_model(model_id: str) -> dict[str, Any]:
        _, name = current(model_id)
        return model_card(name)

    @app.post("/v1/completions", dependencies=user)
    async def completions(request: Request, body: CompletionRequest) -> Any:
        model, name = current(body.model)
        return await generation.completions(request, body, model, name)

    @app.post("/v1/chat/completions", dependencies=user)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Any:
        model, name = current(body.model)
        return await generation.chat_completions(request, body, model, name)

    @app.post("/v1/embeddings", dependencies=user)
    async def create_embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        model, name = current(body.model)
        return await embeddings.embeddings(body, model, name)

    @app.get("/v1/internal/health", dependencies=user)
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model_loaded": manager.is_loaded()}

    @app.get("/v1/internal/model/info", dependencies=user)
    async def model_info() -> dict[str, Any]:
        model, name = current(None)
        info = model.info()
        return {"model_name": name, "lora_names": list(info.get("loras") or {}), "info": info}

    # -- admin ---------------------------------------------------------------------------
    async def blocking(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(func, *args, **kwargs)
        except Exception as error:
            raise error_for(error) from error

    @app.get("/v1/internal/model/list", dependencies=admin)
    async def admin_list_models() -> dict[str, Any]:
        entries = manager.list_models()
        return {
            "model_names": [e.name for e in entries],
            "models": [
                {"name": e.name, "format": e.format, "size_bytes": e.size_bytes, "bits": e.bits}
                for e in entries
            ],
        }

    @app.post("/v1/internal/model/load", dependencies=admin)
    async def admin_load_model(body: LoadModelRequest) -> dict[str, Any]:
        reserved = sorted(set(body.args) & RESERVED_LOAD_ARGS)
        if reserved:  # keywords of ModelManager.load itself, not loader options
            raise ApiError(
                400,
                f"args.{reserved[0]} is not a loader option (args takes options such as "
                "max_seq_len, cache_tokens, cache_type)",
                param=f"args.{reserved[0]}",
            )
        try:
            manager.check_switch()  # before any option is looked at
        except ModelPinnedError as error:
            raise error_for(error) from error
        args = dict(body.args)
        try:
            args = with_cache_default(args, manager.resolve_model(body.model_name), body.loader)
        except UnknownNameError:
            pass  # manager.load says so, as a 404
        model = await blocking(manager.load, body.model_name, body.loader, **args)
        return {"status": "loaded", "model_name": body.model_name, "info": model.info()}

    @app.post("/v1/internal/model/unload", dependencies=admin)
    async def admin_unload_model() -> dict[str, Any]:
        await blocking(manager.check_switch)
        await blocking(manager.unload)
        return {"status": "unloaded"}

    @app.get("/v1/internal/lora/list", dependencies=admin)
    async def admin_list_loras() -> dict[str, Any]:
        return {"lora_names": [e.name for e in manager.list_loras()]}

    def load_loras(body: LoraRequest) -> dict[str, Any]:
        model = manager.current()
        weights = body.lora_weights or [1.0] * len(body.lora_names)
        if len(weights) != len(body.lora_names):
            raise ApiError(
                400,
                f"{len(weights)} lora_weights for {len(body.lora_names)} lora_names",
                param="lora_weights",
            )
        for i, weight in enumerate(weights):
            if not math.isfinite(weight) or abs(weight) > MAX_LORA_WEIGHT:
                raise ApiError(
                    400,
                    f"lora_weights[{i}] is {weight!r}; a LoRA scale is a number in "
                    f"[-{MAX_LORA_WEIGHT:g}, {MAX_LORA_WEIGHT:g}]",
                    param=f"lora_weights.{i}",
                )
        loaded = {}
        for name, weight in zip(body.lora_names, weights, strict=True):
            try:
                path = manager.resolve_lora(name)
            except UnknownNameError as error:
                raise ApiError(404, str(error), param="lora_names", code="lora_not_found") from None
            loaded[model.load_lora(path, name)] = weight
        model.set_loras(loaded)
        return {"status": "loaded", "lora_names": list(loaded)}

    @app.post("/v1/internal/lora/load", dependencies=admin)
    async def admin_load_loras(body: LoraRequest) -> dict[str, Any]:
        return await blocking(load_loras, body)

    def unload_loras(body: LoraRequest) -> dict[str, Any]:
        model = manager.current()
        names = body.lora_names or list(model.info().get("loras") or {})
        for name in names:
            model.unload_lora(name)
        return {"status": "unloaded", "lora_names": names}

    @app.post("/v1/internal/lora/unload", dependencies=admin)
    async def admin_unload_loras(body: LoraRequest | None = None) -> dict[str, Any]:
        return await blocking(unload_loras, body or LoraRequest())

    @app.get("/openapi.json", dependencies=user, include_in_schema=False)
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        return JSONResponse({"status": "ok", "docs": "OpenAI-compatible API under /v1"})

    return app
