"""`create_app(engine, config)`: the FastAPI application. All state lives on `app.state.specdec`."""
from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

import specdec
from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.errors import APIError, error_response, install_error_handlers
from specdec.server.metrics import HTTPMetricsMiddleware, ServerMetrics
from specdec.server.routes import ServerState, router
from specdec.server.scheduler import Scheduler

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Every route but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`.",
                                 "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, less its 422 responses: validation errors here are OpenAI-style 400s."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(engine: Engine, config: Optional[ServerConfig] = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics(config.served_model_name)
    scheduler = Scheduler(engine, config, metrics)
    metrics.track_scheduler(lambda: scheduler.num_running, lambda: scheduler.num_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="specdec", version=getattr(specdec, "__version__", "0"), lifespan=lifespan,
                  description="OpenAI-compatible server with lossless speculative decoding.")
    app.openapi = lambda: _openapi(app)
    app.state.specdec = ServerState(engine, config, scheduler, metrics, int(time.time()))
    install_error_handlers(app)
    app.include_router(router)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    return app
