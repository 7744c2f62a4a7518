"""Middlewares for Ray Serve's HTTP proxy: the plain server's key check and body limits, in the
same order, before the proxy reads or parses a body; a response that its replica could not finish
still ends the way an OpenAI client expects; errors Ray answers itself come as OpenAI JSON; and the
request router learns the request's tenant and what its prompt starts with.

Outermost first (`middlewares()`):

    ReplicaFailureGuard   a response its replica did not finish ends with an error (below)
    AuthMiddleware        the key (server/tenants.py): 401 before a byte of the body is read
    TenantRoutingHeader   the key's tenant, for the router (a header the client sent is dropped)
    BodyLimitMiddleware   413 from Content-Length before reading, or as the bytes pass the limit;
                          408 for a body slower than the timeout (server/limits.py)
    BufferedBody          the whole body read here, where those errors can be answered
    PromptPrefixHeader    digests of the prompt's start and of the session key, for the router (JSON
                          decoded off the event loop when large)
    RayErrorsAsJSON       Ray's own plain-text errors (a full queue, no replica, ...) as OpenAI JSON

A replica that dies mid-stream leaves Ray's proxy with nothing to send: it stops, and the client
would see a connection cut short (or, before any byte, nothing at all). The guard ends such a
stream with ONE OpenAI error event and `data: [DONE]` (what `specdec serve` sends when a stream
fails after it started, sse.py), and answers a request that got no response at all with a 502
error body. The client can tell the failure and retry.

Ray calls `middlewares()` in each proxy process, with no arguments: the keys and limits come from
that process's environment, the environment `ray start` ran in (`specdec serve --ray` sets it for
the local Ray it starts, cli.py): SPECDEC_API_KEYS_FILE / SPECDEC_API_KEYS / SPECDEC_API_KEY as for
`specdec serve`, SPECDEC_MAX_BODY_BYTES and SPECDEC_BODY_TIMEOUT (default: `specdec serve`'s). Ray
reads the callback itself from RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in the same environment:
`specdec.deploy.proxy:middlewares`. Replicas check the key again (the app is `specdec serve`'s).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from starlette.middleware import Middleware

from specdec.deploy.prefix import (PREFIX_HEADER, ROUTED_PATHS, SESSION_HEADER, encode_header, prefix_digests,
                                   prompt_text, session_digest)
from specdec.deploy.router import TENANT_HEADER
from specdec.server.app import OPEN_PATHS
from specdec.server.config import ServerConfig
from specdec.server.errors import APIError, error_body
from specdec.server.limits import BodyLimitMiddleware, off_loop_if_large
from specdec.server.sse import DONE, sse_error
from specdec.server.tenants import APIKeys, AuthMiddleware, configured_keys, tenant_of_scope
from specdec.types import SpecdecError

logger = logging.getLogger("specdec.deploy")

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "specdec.deploy.proxy:middlewares"
MAX_BODY_BYTES_ENV = "SPECDEC_MAX_BODY_BYTES"
BODY_TIMEOUT_ENV = "SPECDEC_BODY_TIMEOUT"
# Ray's own health and route table answer load balancers without a key, as /health does. /metrics
# is left to the replica, which knows whether it is public (`--public-metrics`); a GET has no body.
RAY_PATHS = frozenset({"/-/healthz", "/-/routes"})
PROXY_OPEN_PATHS = OPEN_PATHS | RAY_PATHS | {"/metrics"}

REPLICA_FAILED = APIError(502, "the replica serving this request failed before it finished; retry the request.",
                          "server_error", None, "replica_failed")


@dataclass(frozen=True)
class ProxySettings:
    keys: APIKeys
    max_body_bytes: int
    body_timeout: float

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> "ProxySettings":
        environ = os.environ if environ is None else environ
        api_key, pairs = configured_keys(environ=environ)
        defaults = ServerConfig()
        return cls(APIKeys.of(api_key, pairs),
                   _setting(environ, MAX_BODY_BYTES_ENV, int, defaults.max_body_bytes),
                   _setting(environ, BODY_TIMEOUT_ENV, float, defaults.body_timeout))


def _setting(environ: Mapping[str, str], name: str, kind: Callable, default):
    text = environ.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise SpecdecError(f"${name} must be a positive {'integer' if kind is int else 'number'}, not {text!r}.")
    return value


def proxy_environment(config: ServerConfig) -> dict[str, str]:
    """The variables that give Ray's proxies `config`'s body limits (cli.py, for the Ray it starts)."""
    return {MAX_BODY_BYTES_ENV: str(config.max_body_bytes), BODY_TIMEOUT_ENV: repr(config.body_timeout)}


# -- the body ---------------------------------------------------------------------------------------
async def read_body(receive) -> tuple[bytes, dict]:
    """The request's whole body, and the last message read (a disconnect, if the client left)."""
    chunks, message = [], {"type": "http.request"}
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left: the app sees that as it would have
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), message


def replaying(body: bytes, last: dict, receive):
    """A receive that gives the body read in one message (or the disconnect), then what follows."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            if last["type"] != "http.request":
                return last
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class BufferedBody:
    """Reads every HTTP request's body before the app behind it runs, then hands it on whole.

    Ray's proxy reads a body in a task of its own, beside the request: an error raised there (the
    body limit's 413 or 408, outside this) would only end that task, which Ray takes for the client
    leaving (it cancels the request and answers nothing). Read here, the error reaches the limit's
    middleware, which answers it. Ray's proxy holds a body until the replica asks for it anyway,
    so this holds nothing it would not."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, last = await read_body(receive)
        await self.app(scope, replaying(body, last, receive), send)


def routing_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """The prompt's prefix digests and the session key's digest, as headers (prefix.py)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (or too deep): the replica answers 400 as usual
        return []
    headers, digests, session = [], prefix_digests(prompt_text(parsed)), session_digest(parsed)
    if digests:
        headers.append((PREFIX_HEADER, encode_header(digests)))
    if session is not None:
        headers.append((SESSION_HEADER, session.encode("ascii")))
    return headers


class PromptPrefixHeader:
    """Reads a completion request's JSON body in the proxy and passes digests of its prompt's
    leading blocks and of its session key to the request router in headers (prefix.py), replacing
    any the client sent; the body then goes on to the replica unchanged. A body over
    OFF_LOOP_JSON_BYTES is decoded in a worker thread: a megabyte of JSON would stall every other
    request of the proxy meanwhile."""

    MAX_BODY = 4 << 20  # larger bodies are forwarded without the headers

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ROUTED_PATHS:
            return await self.app(scope, receive, send)
        body, last = await read_body(receive)
        headers = [(name, value) for name, value in scope.get("headers", ())
                   if name.lower() not in (PREFIX_HEADER, SESSION_HEADER)]
        if len(body) <= self.MAX_BODY:
            headers += await off_loop_if_large(routing_headers, body)
        await self.app({**scope, "headers": headers}, replaying(body, last, receive), send)


# -- who is asking ----------------------------------------------------------------------------------
class TenantRoutingHeader:
    """The tenant of the request's key (AuthMiddleware, outside this, put it in the scope's state)
    in a header for the router, so that every key of one tenant routes alike; one the client sent
    is dropped. Routing only: the replica takes the tenant from the key again."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = [(name, value) for name, value in scope.get("headers", ()) if name.lower() != TENANT_HEADER]
        tenant = tenant_of_scope(scope)
        if tenant is not None:
            headers.append((TENANT_HEADER, tenant.encode("ascii")))  # tenant names are ASCII (tenants.py)
        await self.app({**scope, "headers": headers}, receive, send)


# -- responses --------------------------------------------------------------------------------------
class ReplicaFailureGuard:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = {"started": False, "event_stream": False, "ended": False}

        async def watched_send(message):
            if message["type"] == "http.response.start":
                seen["started"] = True
                content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
                seen["event_stream"] = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            raise  # the client went away: nobody to tell
        except Exception:
            logger.exception("the proxy failed while forwarding %s", scope.get("path"))
        if seen["ended"]:
            return
        try:
            if not seen["started"]:
                body = json.dumps(error_body(REPLICA_FAILED.message, REPLICA_FAILED.type, None, REPLICA_FAILED.code))
                await send({"type": "http.response.start", "status": REPLICA_FAILED.status,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body.encode()})
            elif seen["event_stream"]:
                await send({"type": "http.response.body", "body": sse_error(REPLICA_FAILED) + DONE})
            else:  # a plain body cut short cannot be repaired: end it, the client sees it truncated
                await send({"type": "http.response.body", "body": b""})
        except Exception:  # the connection is gone too
            logger.debug("could not end the response of %s", scope.get("path"), exc_info=True)


REPLICA_HEADER = b"x-specdec-replica"  # replica.py's ReplicaHeaders: the replica answered, not Ray
MAX_RAY_MESSAGE = 1000  # characters of Ray's text kept in the error's message
RAY_ERRORS = {  # status: (type, code) of what Ray answers itself
    429: ("rate_limit_error", "queue_full"),  # max_queued_requests reached (app.py: as a 429)
    503: ("server_error", "unavailable"),  # no replica can take it (none running, the app failed)
    408: ("invalid_request_error", "request_timeout"),  # past Ray's request_timeout_s
    404: ("not_found_error", "not_found"),  # no application on that route (not deployed yet)
}


def ray_error(status: int, text: str) -> dict:
    kind, code = RAY_ERRORS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return error_body(f"Ray Serve: {text.strip()[:MAX_RAY_MESSAGE] or 'no message'}", kind, None, code)


class RayErrorsAsJSON:
    """Ray's proxy answers some requests itself, with a plain-text body: a deployment whose queue
    is full (backpressure), one with no replica to take the request, a route with no application.
    Those become OpenAI error bodies, status and headers (Retry-After) kept. A replica's own
    responses, which name it (X-Specdec-Replica), and Ray's /-/healthz and /-/routes, which load
    balancers read, pass as they are."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in RAY_PATHS:
            return await self.app(scope, receive, send)
        held: Optional[dict] = None  # Ray's error response, while its body arrives
        text = bytearray()

        async def rewriting_send(message):
            nonlocal held
            if message["type"] == "http.response.start" and is_rays_error(message):
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            text.extend(message.get("body", b"")[:MAX_RAY_MESSAGE * 4])
            if message.get("more_body", False):
                return
            body = json.dumps(ray_error(held["status"], text.decode("utf-8", "replace")), ensure_ascii=True).encode()
            headers = [(name, value) for name, value in held.get("headers") or ()
                       if bytes(name).lower() not in (b"content-type", b"content-length")]
            await send({**held, "headers": [*headers, (b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            held = None

        await self.app(scope, receive, rewriting_send)


def is_rays_error(start: dict) -> bool:
    headers = {bytes(name).lower(): bytes(value) for name, value in start.get("headers") or ()}
    return (start.get("status", 200) >= 400 and REPLICA_HEADER not in headers
            and headers.get(b"content-type", b"text/plain").startswith(b"text/plain"))


def middlewares(environ: Optional[Mapping[str, str]] = None) -> list[Middleware]:
    """The callback Ray's proxy calls (CALLBACK_ENV). Ray wraps the app in them in list order, so
    the last is outermost: the key is checked before the body's size, the body read before its
    prompt, and the guard also ends a response that failed inside any of them."""
    try:
        settings = ProxySettings.from_environment(environ)
    except SpecdecError as exc:
        logger.error("specdec's proxy middlewares: %s", exc)  # the proxy's log says why it did not start
        raise
    if settings.keys:
        logger.info("the proxy checks API keys (tenants: %s)", ", ".join(settings.keys.tenants))
    return [Middleware(RayErrorsAsJSON), Middleware(PromptPrefixHeader), Middleware(BufferedBody),
            Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout),
            Middleware(TenantRoutingHeader),
            Middleware(AuthMiddleware, keys=settings.keys, open_paths=PROXY_OPEN_PATHS),
            Middleware(ReplicaFailureGuard)]
