"""`create_app(engine, config)`: the FastAPI application. All state lives on `app.state.specdec`."""
from __future__ import annotations

import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Awaitable, Callable, Optional

import anyio.to_thread
from fastapi import FastAPI

import specdec
from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.drain import Drain
from specdec.server.engine_users import EngineUsersMiddleware
from specdec.server.errors import install_error_handlers
from specdec.server.hosts import HostAllowListMiddleware
from specdec.server.limits import BodyLimitMiddleware
from specdec.server.llama_server_api import router as llama_server_router
from specdec.server.metrics import HTTPMetricsMiddleware, ServerMetrics
from specdec.server.openapi import openapi_document
from specdec.server.playground import PAGE_PATHS
from specdec.server.playground import router as playground_router
from specdec.server.routes import STREAM_CHUNKS, ServerState, router
from specdec.server.scheduler import Scheduler
from specdec.server.tenants import METRICS_PATH, APIKeys, AuthMiddleware

OPEN_PATHS = frozenset({"/health"}) | PAGE_PATHS  # the playground's files: a browser opens them without a key
logger = logging.getLogger("specdec.server")


def cross_request_sizes(engine: Engine) -> tuple[int, int]:
    """(tenants, tokens) held by the engine's cross-request histories."""
    return engine.cross_request.sizes()


def create_app(engine: Engine, config: Optional[ServerConfig] = None,
               metrics_exposition: Optional[Callable[[ServerMetrics], Awaitable[bytes]]] = None) -> FastAPI:
    """`metrics_exposition`: how GET /metrics produces its text from the app's metrics (default:
    the app's own registry); a host that gathers several apps' series passes its own."""
    config = config or ServerConfig()
    metrics = ServerMetrics(config.served_model_name)
    scheduler = Scheduler(engine, config, metrics)
    metrics.track_scheduler(lambda: scheduler.num_running, lambda: scheduler.num_waiting)
    metrics.track_caches(lambda: cross_request_sizes(scheduler.engine)[0], lambda: cross_request_sizes(scheduler.engine)[1],
                         lambda: sum(len(slot.target.tokens) for slot in scheduler.engine.slots))
    metrics.track_prompt_cache(lambda: scheduler.engine.prompt_cache, lambda: scheduler.engine.draft_copies)

    drain = Drain(scheduler, config.drain_grace)

    # Start-up and stop live here, so that every host of the app (uvicorn in `specdec serve`, a Ray
    # Serve replica) starts and stops the same runtime the same way.
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine.cost_model is None:
            # Any request may ask for `auto`: measure its costs now, before the first request,
            # rather than in the worker, where it would stall every stream for the ~10 s it takes.
            scheduler.costs.offer(engine, await anyio.to_thread.run_sync(engine.measure_costs), "start-up")
        else:
            scheduler.costs.last_good = engine.cost_model
        scheduler.start()
        # The grammar library's view of the vocabulary (about a second), read before a first
        # structured request would wait for it; serving does not wait.
        threading.Thread(target=lambda: engine.grammars.tokenizer, name="specdec-grammar-vocab", daemon=True).start()
        try:
            yield
        finally:
            await drain.run()  # already over under `specdec serve`, which drains before it stops listening
            if not scheduler.stop(timeout=15.0):
                logger.error("the scheduler's worker is still inside a backend call; the models stay loaded")
            elif scheduler.engine.prompt_cache_folder is not None:
                try:  # nothing runs now: the conversations held go to disk for the next start
                    written = await anyio.to_thread.run_sync(scheduler.engine.write_prompt_cache)
                    logger.info("wrote %d conversations' prompt starts to %s", written, scheduler.engine.prompt_cache_folder)
                except Exception:
                    logger.exception("could not write the prompt cache")

    app = FastAPI(title="specdec", version=getattr(specdec, "__version__", "0"), lifespan=lifespan,
                  description="OpenAI-compatible server with lossless speculative decoding.")
    app.openapi = lambda: openapi_document(app, STREAM_CHUNKS)  # type: ignore[method-assign]  # FastAPI's documented override
    app.state.specdec = ServerState(engine, config, scheduler, metrics, int(time.time()), drain,
                                    metrics_exposition)
    # A server that moves onto a better build (upgrade.py) tokenizes with the new engine from then on.
    scheduler.engine_listeners.append(lambda new: setattr(app.state.specdec, "engine", new))
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(llama_server_router)
    app.include_router(playground_router)
    # Innermost: a request's whole life holds the engine it may have read (engine_users.py).
    app.add_middleware(EngineUsersMiddleware, users=scheduler.users)
    # Outermost last: every request is counted; its Host is checked first (DNS rebinding), then its
    # key (a 401 before the body is read), then its body's size and pace.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout=config.body_timeout)
    open_paths = OPEN_PATHS | ({METRICS_PATH} if config.public_metrics else set())
    app.add_middleware(AuthMiddleware, keys=APIKeys.of(config.api_key, config.api_keys), open_paths=frozenset(open_paths),
                       metrics_key=config.metrics_key)
    if config.allowed_hosts is not None:
        app.add_middleware(HostAllowListMiddleware, allowed=config.allowed_hosts)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    return app
