"""Bounds on what one request may make the server read, parse and hold.

- `BodyLimitMiddleware`: a body larger than `max_bytes` is a 413, answered from the
  Content-Length header before a byte of the body is read, or, for a body without one (chunked),
  as soon as the bytes received pass the limit; a body that takes longer than `timeout` seconds
  to arrive (a slow upload) is a 408. Both close the connection, so the rest is never read.
- `OffLoopJSONRoute`: FastAPI's routes, with large bodies decoded by json.loads in a worker
  thread, so a megabyte body does not stall /health and every open stream meanwhile (its
  validation, in pydantic-core, stays on the loop; it is bounded by the body's size).
- `prompt_byte_limit` (convert.py's check_prompt_size): a prompt whose text cannot fit the
  context is refused before it is rendered and tokenized (tokenizing allocates several bytes per
  byte of text, then a Python int per token).
"""
from __future__ import annotations

import json
import time
from typing import Callable, Optional, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.routing import APIRoute

from specdec.server.errors import APIError, HTTPAPIError, error_response
from specdec.server.offload import off_loop
from specdec.server.tenants import tenant_of_scope

# Bodies above this are decoded in a worker thread; smaller ones decode faster than a thread hop.
OFF_LOOP_JSON_BYTES = 64 << 10
# A token holds at most this many bytes of text in any tokenizer we serve (real text averages 3-5):
# a prompt of more bytes than the context times this cannot fit, whatever it tokenizes into.
PROMPT_BYTES_PER_TOKEN = 64
CLOSE = {"Connection": "close"}  # the rest of a refused body is never read
T = TypeVar("T")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes.",
                    "invalid_request_error", None, "request_too_large", CLOSE)


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"the request body did not arrive within {seconds:g}s.", "invalid_request_error", None,
                    "request_timeout", CLOSE)


def content_length(headers) -> Optional[int]:
    """The Content-Length header's value (h11 has checked it is one decimal number), or None."""
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value)
    return None


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.clock = clock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = content_length(scope.get("headers") or ())
        if length is not None and length > self.max_bytes:
            return await error_response(body_too_large(self.max_bytes), scope.get("path"))(scope, receive, send)
        deadline = self.clock() + self.timeout
        body = {"received": 0, "done": False}
        started = False

        async def limited_receive():
            if body["done"]:  # later receives wait for a disconnect: no limit on them
                return await receive()
            try:
                with anyio.fail_after(max(0.0, deadline - self.clock())):
                    message = await receive()
            except TimeoutError:
                raise HTTPAPIError(body_timeout(self.timeout)) from None
            if message["type"] == "http.request":
                body["received"] += len(message.get("body", b""))
                if body["received"] > self.max_bytes:
                    raise HTTPAPIError(body_too_large(self.max_bytes))
                body["done"] = not message.get("more_body", False)
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except HTTPAPIError as exc:  # raised above, and not answered by the app (it read the body itself)
            if started:
                raise
            await error_response(exc.error, scope.get("path"))(scope, receive, send)


async def off_loop_if_large(function: Callable[[bytes], T], body: bytes, tenant=None) -> T:
    """function(body), in a worker thread when the body is over OFF_LOOP_JSON_BYTES."""
    if len(body) > OFF_LOOP_JSON_BYTES:
        return await off_loop(function, body, tenant=tenant)
    return function(body)


class OffLoopJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            self._json = await off_loop_if_large(json.loads, await self.body(), tenant_of_scope(self.scope))
        return self._json


class OffLoopJSONRoute(APIRoute):
    """FastAPI's documented way to change how a route reads its request (a custom Request class)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def off_loop_handler(request: Request) -> Response:
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return off_loop_handler


def prompt_byte_limit(n_ctx: int, max_prompt_bytes: Optional[int]) -> int:
    limit = n_ctx * PROMPT_BYTES_PER_TOKEN
    return limit if max_prompt_bytes is None else min(limit, max_prompt_bytes)
