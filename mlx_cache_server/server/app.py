"""The FastAPI application: the engine it serves from, its routes, middleware and docs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse

from ..engine import Engine
from ..models.loader import ModelLoader
from ..models.pool import ModelPool
from ..models.specs import ModelSpec
from ..serving.metrics import Metrics
from ..serving.openai_bodies import ErrorResponse
from ..serving.served_model import ServedModel, serve_engine, serving
from ..settings import Settings
from . import error_handlers, routes
from .auth import authorize
from .connections import HeaderLimit
from .middleware import BodyLimit, RequestCounter
from .state import ServerState

log = logging.getLogger("mlx_cache_server")


def create_app(
    models: ModelPool | Engine, settings: Settings | None = None, metrics: Metrics | None = None
) -> FastAPI:
    """The app serving `models`: a pool of configured models, or one engine already built."""
    settings = settings or Settings()
    metrics = metrics or Metrics()
    pool = models if isinstance(models, ModelPool) else single_model(models, settings, metrics)
    metrics.watch(pool)
    app = FastAPI(
        title="mlx-cache-server",
        summary="OpenAI-compatible MLX server with a shared prefix-sharing prompt cache",
        version="0.1.0",
        openapi_url=None,  # served below, behind the API keys like the API itself
        docs_url=None,
        redoc_url=None,
        lifespan=_sweeping(pool),
    )
    app.state.server = ServerState(
        settings=settings, metrics=metrics, started=int(time.time()), models=pool
    )
    error_handlers.install(app)
    for module in (
        routes.chat, routes.completions, routes.messages, routes.responses, routes.embeddings,
        routes.models, routes.health, routes.cache, routes.metrics,
    ):  # fmt: skip
        app.include_router(module.router)
    app.include_router(routes.models.admin)
    if settings.ui:
        app.include_router(routes.ui.router)
    app.openapi = lambda: _openapi(app)
    _serve_docs(app)
    if settings.cors_origins:
        # Browsers' chat UIs; credentials stay off: API keys travel in a header.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_credentials=False,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
    app.add_middleware(HeaderLimit)
    app.add_middleware(RequestCounter, metrics=metrics)
    return app


_ERROR_CODES = {
    "400": "Invalid request, or a model that cannot fit the memory budget",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "408": "Generation took longer than the request timeout",
    "413": "Request body too large",
    "429": "Too many requests waiting; retry after the Retry-After header",
    "403": "Admin routes are off: the server has API keys and no admin key",
    "431": "Request headers too large, or too many",
    "409": "The model has requests running, or is pinned",
    "503": "The model could not be loaded, or not in time",
}
_GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
_EMBEDDINGS = "/v1/embeddings"


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the errors this server really returns (OpenAI's shape, no 422)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/health":
                responses["503"] = {"description": "The engine is not running"}
                continue
            codes = ["400", "401", "413", "431"]
            admin = path.endswith(("/load", "/unload"))
            if path.startswith("/v1/cache") or path == "/metrics" or admin:
                codes.append("403")
            if path in _GENERATION:
                codes += ["404", "408", "429", "503"]
                # Each event: its data (a JSON text; OpenAI's `[DONE]`), and its type
                # where the API names it (Anthropic's and the Responses API's).
                text = {"type": "string"}
                event = {"type": "object", "properties": {"event": text, "data": text}}
                responses["200"]["content"]["text/event-stream"] = {"schema": event}
            elif path == _EMBEDDINGS:
                codes += ["404", "429", "503"]
            elif "{" in path or path.startswith("/v1/cache") or path == "/v1/messages/count_tokens":
                codes.append("404")
            if path == "/v1/cache/events":  # each event's data: /v1/cache/tree's body as JSON
                event = {"type": "object", "properties": {"data": {"type": "string"}}}
                responses["200"]["content"] = {"text/event-stream": {"schema": event}}
            if admin:
                codes += ["409", "503"]
            for code in codes:
                responses[code] = {"description": _ERROR_CODES[code], "content": error}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    app.openapi_schema = schema
    return schema


def _serve_docs(app: FastAPI) -> None:
    keyed = [Depends(authorize)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=keyed)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=keyed)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)


def single_model(engine: Engine, settings: Settings, metrics: Metrics) -> ModelPool:
    """A pool of the one engine given, pinned: a test's, or a program's that built its own."""
    spec = ModelSpec(engine.model_id, None, tuple(settings.model_aliases), pinned=True)
    loader = ModelLoader(settings, serving(metrics, lambda s: pool.naming(s)))
    pool: ModelPool[ServedModel] = ModelPool([spec], loader, answer_any=settings.answer_any_model)
    pool.adopt(spec, serve_engine(spec, engine, settings, metrics, pool.naming(spec)))
    return pool


def _sweeping(pool: ModelPool):
    """The app's lifespan: idle models unloaded (their ttl) while it serves."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(pool.sweep_forever())
        try:
            yield
        finally:
            task.cancel()

    return lifespan
