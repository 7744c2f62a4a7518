"""Middlewares for Ray Serve's HTTP proxy: a response that its replica could not finish still ends
the way an OpenAI client expects, and the request router learns what a prompt starts with.

A replica that dies mid-stream leaves Ray's proxy with nothing to send: it stops, and the client
would see a connection cut short (or, before any byte, nothing at all). This middleware, which
runs in the proxy, ends such a stream with ONE OpenAI error event and `data: [DONE]` (what
`specdec serve` sends when a stream fails after it started, sse.py), and answers a request that
got no response at all with a 502 error body. The client can tell the failure and retry.

Ray reads the proxy's middlewares from RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in the
environment of the Ray processes (set it before `ray start`; `specdec serve --ray` sets it for
the local Ray it starts): `specdec.deploy.proxy:middlewares`.
"""
from __future__ import annotations

import asyncio
import json
import logging

from starlette.middleware import Middleware

from specdec.deploy.prefix import COMPLETION_PATHS, PREFIX_HEADER, encode_header, prefix_digests, prompt_text
from specdec.server.errors import APIError, error_body
from specdec.server.sse import DONE, sse_error

logger = logging.getLogger("specdec.deploy")

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "specdec.deploy.proxy:middlewares"

REPLICA_FAILED = APIError(502, "the replica serving this request failed before it finished; retry the request.",
                          "server_error", None, "replica_failed")


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


class PromptPrefixHeader:
    """Reads a completion request's JSON body in the proxy and passes digests of its prompt's
    leading blocks to the request router in a header (prefix.py), replacing any the client sent;
    the body then goes on to the replica unchanged."""

    MAX_BODY = 4 << 20  # larger bodies are forwarded without the header

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in COMPLETION_PATHS:
            return await self.app(scope, receive, send)
        chunks, message = [], {"type": "http.request"}
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the app sees that as it would have
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        headers = [(name, value) for name, value in scope.get("headers", ()) if name.lower() != PREFIX_HEADER]
        if len(body) <= self.MAX_BODY:
            try:
                digests = prefix_digests(prompt_text(json.loads(body)))
            except (ValueError, RecursionError):  # not JSON (or too deep): the replica answers 400 as usual
                digests = []
            if digests:
                headers.append((PREFIX_HEADER, encode_header(digests)))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                if message["type"] != "http.request":
                    return message
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": headers}, replay, send)


def middlewares() -> list[Middleware]:
    """The callback Ray's proxy calls (CALLBACK_ENV). Ray wraps the app in them in list order, so
    the last is outermost: the guard also ends a response that failed inside the prefix one."""
    return [Middleware(PromptPrefixHeader), Middleware(ReplicaFailureGuard)]
