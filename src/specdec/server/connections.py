"""uvicorn's settings for slow and numerous clients (`specdec serve`).

uvicorn bounds a request's headers in size (`h11_max_incomplete_event_size`) and idle keep-alive
connections in time (`timeout_keep_alive`), but not the time a client may take to send its
headers: a client that sends one byte every few seconds holds its connection forever
(slowloris). `HeaderTimeoutProtocol` is uvicorn's h11 protocol with that timer added: from a
connection's first byte (or the first byte after the previous response) its request's headers
must have arrived within `header_timeout` seconds, or the connection is closed (a new connection
that sends nothing at all is closed after as long). The body's own
time limit is server/limits.py's (a 408).

A reader that stops reading holds its connection too, and the protocol adds a second timer for
it: once the kernel's buffers and uvicorn's 64 KiB are full, writing pauses, and a connection
whose writing stays paused for `write_timeout` seconds is aborted (an EventStreamResponse ends its
stream and generation at the same moment, sse.py; uvicorn's own `close()` of the connection would
wait for the unread bytes to be read, forever, and the connection would count against
the connection limit meanwhile). An answer left unread below the pause mark gets the same time
once the keep-alive timeout closes its connection, then the connection is aborted.

The connection limit is the protocol's too (uvicorn's `limit_concurrency` would refuse /health
with the rest): past `connection_limit` connections or requests at once, a request gets an OpenAI
503 and its connection is closed, except /health, answered whatever the count, so that slow
bodies holding every connection cannot make a healthy server look dead to its orchestrator.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from specdec.server.config import ServerConfig
from specdec.server.errors import APIError, error_response

logger = logging.getLogger("specdec.server")
UNLIMITED_PATHS = frozenset({"/health"})
OVER_LIMIT = APIError(503, "the server has as many connections as it takes (--limit-concurrency); retry shortly.",
                      "server_error", None, "too_many_connections", {"Connection": "close", "Retry-After": "1"})


class HeaderTimeoutProtocol(H11Protocol):
    def __init__(self, *args, header_timeout: float, write_timeout: Optional[float] = None,
                 connection_limit: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.write_timeout = write_timeout
        self.connection_limit = connection_limit
        self._app = self.app
        self.app = self._limited  # every request cycle runs the app through the limit
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._write_timer: Optional[asyncio.TimerHandle] = None
        self._cycle_seen: Optional[RequestResponseCycle] = None  # the request cycle whose headers have arrived

    async def _limited(self, scope, receive, send) -> None:
        limit = self.connection_limit
        # self.tasks holds this request's task already: more than `limit` is one too many
        if (limit is not None and scope["type"] == "http" and scope["path"] not in UNLIMITED_PATHS
                and (len(self.connections) > limit or len(self.tasks) > limit)):
            logger.warning("over --limit-concurrency (%d): a 503 for %s", limit, scope["path"])
            return await error_response(OVER_LIMIT, scope["path"])(scope, receive, send)
        return await self._app(scope, receive, send)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers():
            self._arm()
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._cycle_seen:  # a request's headers are in
            self._cycle_seen = self.cycle
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._stop_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_timeout is not None and self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():  # `Connection: close`, or the response could not keep the connection
            self._bound_close()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._bound_close()

    def _bound_close(self) -> None:
        """close() waits for the bytes still buffered to be sent; a reader that stopped reading with
        less than the pause mark unread never paused writing, so no timer would end that wait."""
        if (self.write_timeout is not None and self._write_timer is None
                and self.transport.get_write_buffer_size()):
            self._write_timer = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def _write_timed_out(self) -> None:
        self._write_timer = None
        self.transport.abort()  # connection_lost follows: the response's sends return, the app sees a disconnect

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()


def uvicorn_settings(config: ServerConfig) -> dict:
    """uvicorn.Config's arguments for the server's limits."""
    return dict(
        http=functools.partial(HeaderTimeoutProtocol, header_timeout=config.header_timeout,
                               write_timeout=config.write_timeout, connection_limit=config.limit_concurrency),
        timeout_keep_alive=config.keep_alive_timeout,
        limit_concurrency=None,  # the protocol's own limit, which answers /health
        h11_max_incomplete_event_size=config.max_header_bytes,
    )
