"""Draining on SIGTERM: `make_server(app, ...)` builds a uvicorn server that finishes its work
before it stops listening.

The first SIGTERM/SIGINT starts a drain: the scheduler refuses new requests (503
`shutting_down`; /health 503 "draining") while the socket stays open, so a client gets an answer
rather than a refused connection, and the requests in flight go on. The drain ends when nothing is
in flight, after `drain_grace` seconds, or at a second signal; whatever is still in flight then
ends with the shutting_down error (in a stream: the error event, then [DONE]), and only then does
uvicorn close the socket, letting the last bytes out for up to FLUSH_SECONDS. A third signal is
uvicorn's own (a Ctrl-C then exits at once).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import uvicorn

logger = logging.getLogger("specdec.server")

# After the drain, how long uvicorn waits for responses still being written (the last chunks of
# streams that just ended) before it cancels them.
FLUSH_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, scheduler, drain_grace: float, config: uvicorn.Config):
        super().__init__(config)
        self.scheduler = scheduler
        self.drain_grace = drain_grace
        self.drain_deadline: Optional[float] = None

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            return super().handle_exit(sig, frame)
        self._captured_signals.append(sig)  # re-raised once the server is down, as uvicorn does
        if self.drain_deadline is None:
            self.scheduler.begin_drain()
            self.drain_deadline = time.monotonic() + self.drain_grace
            logger.info("draining: new requests get 503; up to %gs for the requests in flight", self.drain_grace)
        else:
            self.drain_deadline = time.monotonic()  # a second signal ends the drain now

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.scheduler.idle:
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                logger.warning("drain grace period over: ending %d running and %d waiting requests",
                               self.scheduler.num_running, self.scheduler.num_waiting)
                self.scheduler.abort_in_flight()
                self.should_exit = True
        return await super().on_tick(counter)


def make_server(app, host: str, port: int, drain_grace: float, log_level: str = "info") -> DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_SECONDS)
    return DrainingServer(app.state.specdec.scheduler, drain_grace, config)
