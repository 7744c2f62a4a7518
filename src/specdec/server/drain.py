"""Draining: the requests in flight finish before the server stops.

The policy is `Drain`, kept on the app's state and shared by every way of running the app:
  - `specdec serve` (uvicorn): the first SIGTERM/SIGINT begins the drain while the socket stays
    open, so new requests get 503 `shutting_down` (/health 503 "draining") rather than a refused
    connection; uvicorn stops only once the drain is over (`DrainingServer`, the one thing that
    must live in a uvicorn subclass: uvicorn closes its socket as soon as it stops).
  - any ASGI host (a Ray Serve replica): the app's lifespan shutdown runs the same drain before
    the scheduler stops (`Drain.run`); under uvicorn it finds the drain already over.
The drain is over when nothing is in flight, when `grace` seconds have passed, at a second
signal, or when the backend has stalled (the watchdog has already failed its requests; waiting
for a call that does not return would only delay the stop). Whatever is
still in flight then ends with the shutting_down error (in a stream: the error event, then
[DONE]). Under uvicorn the last bytes then get up to FLUSH_SECONDS, and a third signal is
uvicorn's own (a Ctrl-C then exits at once).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional, cast

import uvicorn

logger = logging.getLogger("specdec.server")

# After the drain, how long uvicorn waits for responses still being written (the last chunks of
# streams that just ended) before it cancels them.
FLUSH_SECONDS = 5.0
POLL_SECONDS = 0.05


class Drain:
    def __init__(self, scheduler, grace: float, clock: Callable[[], float] = time.monotonic):
        self.scheduler = scheduler
        self.grace = grace
        self.clock = clock
        self.deadline: Optional[float] = None
        self.over = False

    @property
    def begun(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        """No new requests from now on; those in flight get `grace` seconds. Idempotent."""
        if self.deadline is None:
            self.scheduler.begin_drain()
            self.deadline = self.clock() + self.grace
            logger.info("draining: new requests get 503; up to %gs for the requests in flight", self.grace)

    def end_now(self) -> None:
        """End the grace period now (a second signal)."""
        self.begin()
        self.deadline = self.clock()

    def poll(self) -> bool:
        """True once the drain is over; past the grace period, ends what is still in flight."""
        if self.over:
            return True
        scheduler = self.scheduler
        if scheduler.idle or scheduler.health().status == "unhealthy":
            self.over = True
        elif self.clock() >= cast(float, self.deadline):  # cast: poll() follows begin()
            logger.warning("drain grace period over: ending %d running and %d waiting requests",
                           scheduler.num_running, scheduler.num_waiting)
            scheduler.abort_in_flight()
            self.over = True
        return self.over

    async def run(self) -> None:
        """The whole drain, from wherever it stands (the lifespan's shutdown)."""
        self.begin()
        while not self.poll():
            await asyncio.sleep(POLL_SECONDS)


class DrainingServer(uvicorn.Server):
    """uvicorn, kept listening (and answering 503) until the app's drain is over."""

    def __init__(self, drain: Drain, config: uvicorn.Config):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            return super().handle_exit(sig, frame)
        self._captured_signals.append(sig)  # re-raised once the server is down, as uvicorn does
        if self.drain.begun:
            self.drain.end_now()  # a second signal ends the drain now
        else:
            self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.begun and not self.should_exit and self.drain.poll():
            self.should_exit = True
        return await super().on_tick(counter)


def make_server(app, host: str, port: int, log_level: str = "info") -> DrainingServer:
    from specdec.server.connections import uvicorn_settings

    # The asyncio loop and h11 (connections.py's protocol), explicitly: uvicorn's "auto" would
    # pick uvloop and httptools whenever they are installed (ray[serve] brings both), and the
    # server's behaviour must not depend on which extras are installed.
    # ignore: uvicorn types the timeout as an int, but hands it to asyncio.wait_for, which takes a float
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=FLUSH_SECONDS,  # type: ignore[arg-type]
                            loop="asyncio", **uvicorn_settings(app.state.specdec.config))
    return DrainingServer(app.state.specdec.drain, config)
