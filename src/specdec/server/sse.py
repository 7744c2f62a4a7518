"""Server-sent events: `data: {json}\n\n` per chunk and `data: [DONE]` at the end; a failure
after the stream started is one `data: {"error": {...}}` event before `data: [DONE]`; a comment
`: keep-alive` while a stream waits (for a slot, say) longer than `--sse-keepalive`."""
from __future__ import annotations

import json
import logging
from typing import Callable, Optional, Union

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from specdec.server.errors import APIError, error_body

logger = logging.getLogger("specdec.server")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(payload: Union[BaseModel, dict]) -> bytes:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, ensure_ascii=True, separators=(",", ":"))
    return b"data: " + body.encode("utf-8") + b"\n\n"


def sse_event(kind: str, payload: dict) -> bytes:
    """A named event (`event: <kind>`), as the Responses and Messages APIs send them."""
    return f"event: {kind}\n".encode() + sse_data(payload)


def sse_error(error: APIError) -> bytes:
    return sse_data(error_body(error.message, error.type, error.param, error.code))


class WriteStalled(Exception):
    pass


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends (finished, client gone,
    server shutting down, a reader that stopped reading), so the generation behind it never
    outlives it. A write that blocks for `write_timeout` seconds (the client's receive window and
    the server's buffers full: it stopped reading) ends the stream; the connection is closed."""

    def __init__(self, content, on_close: Callable[[], None], write_timeout: Optional[float] = None):
        super().__init__(content, media_type="text/event-stream", headers=HEADERS)
        self._on_close = on_close
        self._write_timeout = write_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def timed_send(message) -> None:
            with anyio.move_on_after(self._write_timeout) as timer:
                await send(message)
            if timer.cancelled_caught:
                raise WriteStalled()

        try:
            await super().__call__(scope, receive, send if self._write_timeout is None else timed_send)
        except WriteStalled:
            logger.warning("a stream's reader stopped reading for %gs: stream ended", self._write_timeout)
        finally:
            self._on_close()
