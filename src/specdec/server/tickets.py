"""A request's place in the scheduler (`Ticket`), what it receives (`Started`, `StreamEvent`,
`Failed`), and the server-side errors that can end it.

Three threads may end a request: the worker (its generation finished, or failed), the watchdog
(its time limit passed while the worker was stuck in a backend call, or the backend stalled), and
the event loop (the drain's grace period ran out). A ticket takes exactly one final item — the
last event or a failure — and drops whatever anyone posts after it, so a client never gets two
endings, or text after its ending.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Union

from specdec.engine.core import Started  # what a ticket receives once its prompt is processed
from specdec.server.errors import APIError
from specdec.types import GenerationRequest, StreamEvent


class QueueFull(Exception):
    pass


class Refused(Exception):
    """The server takes no new requests: it is draining, or its backend is stalled."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class Failed:
    error: APIError


Item = Union[Started, StreamEvent, Failed]

INTERNAL_ERROR = APIError(500, "internal error while generating.", "server_error", None, "internal_error")
# Answers a request whose client went away before its generation started (nobody reads it; it
# ends the request's coroutine). 499 is the status proxies use for "client closed request".
CLIENT_GONE = APIError(499, "the client closed the request.", "invalid_request_error", None, "client_closed_request")


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down.", "server_error", None, "shutting_down")


def not_accepting_error() -> APIError:
    return APIError(503, "the server is shutting down and accepts no new requests.", "server_error", None,
                    "shutting_down")


def stalled_error(reason: str) -> APIError:
    return APIError(503, f"the server's backend is not responding ({reason}); retry on another server.",
                    "server_error", None, "backend_stalled")


def queue_timeout_error(limit: float, retry_after: int) -> APIError:
    return APIError(503, f"the request waited past the server's time limit of {limit:g}s before it could start; "
                         "retry later.", "server_error", None, "timeout", {"Retry-After": str(retry_after)})


def is_final(item: Item) -> bool:
    return isinstance(item, Failed) or (isinstance(item, StreamEvent) and item.finish_reason is not None)


class Ticket:
    """One request's place in the scheduler. The request's coroutine reads `next()` and may call
    `cancel()` (client gone) from the event loop; the worker, the watchdog and the drain post."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, arrived: float, deadline: float,
                 wake: Callable[[], None]):
        self.request = request
        self.loop = loop
        self.arrived = arrived
        self.deadline = deadline
        self.cancelled = False  # the client went away
        self.timed_out = False  # the time limit ended it
        self.failed: Optional[APIError] = None  # a failure ended it
        self.closed = False  # its final item is posted; nothing more reaches the client
        self._lock = threading.Lock()
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._wake = wake

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._wake()

    async def next(self) -> Item:
        return await self._queue.get()

    def post(self, item: Item) -> bool:
        """Queue an item for the request's coroutine (from any thread); False if the ticket had
        already ended, in which case the item is dropped."""
        with self._lock:
            if self.closed:
                return False
            if is_final(item):
                self.closed = True
                if isinstance(item, Failed):
                    self.failed = item.error
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
        return True
