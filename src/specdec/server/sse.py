"""Server-sent events: `data: {json}\n\n` per chunk and `data: [DONE]` at the end; a failure
after the stream started is one `data: {"error": {...}}` event before `data: [DONE]`."""
from __future__ import annotations

import json
from typing import Callable, Union

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from specdec.server.errors import APIError, error_body

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(payload: Union[BaseModel, dict]) -> bytes:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, ensure_ascii=True, separators=(",", ":"))
    return b"data: " + body.encode("utf-8") + b"\n\n"


def sse_error(error: APIError) -> bytes:
    return sse_data(error_body(error.message, error.type, error.param, error.code))


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends (finished, client gone,
    server shutting down), so the generation behind it never outlives it."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers=HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
