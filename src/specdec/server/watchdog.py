"""The worker's watchdog: keeps time for the scheduler when its worker cannot.

The worker thread enforces the request time limit between iterations; a backend call that never
returns stops it from doing so, and from ever answering the requests it holds. The watchdog runs
in its own thread and, every `tick` seconds,
  - ends requests that waited for a slot past their time limit (503 `timeout`) or whose client
    left the queue,
  - ends running requests the worker has not cut `late_by` seconds after their time limit (the
    text so far, finish_reason "length", as the worker would),
  - declares the backend stalled once one iteration of the worker has lasted `stall_timeout`
    seconds (or its thread has died): /health answers 503 with the reason, every request in
    flight fails with the `backend_stalled` error and new ones are refused, until the call returns.
It never touches a generation or a backend: only tickets and the queue (scheduler.py).
"""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger("specdec.server")

TICK_SECONDS = 0.1
# How late the worker may be in cutting a request at its time limit before the watchdog does it:
# longer than a normal iteration, so that a healthy worker always gets there first.
LATE_BY_SECONDS = 1.0
WORKER_DIED = "the scheduler's worker thread has stopped"


class Watchdog:
    def __init__(self, scheduler, stall_timeout: float, tick: float = TICK_SECONDS, late_by: float = LATE_BY_SECONDS):
        self.scheduler = scheduler
        self.stall_timeout = stall_timeout
        self.tick = tick
        self.late_by = late_by
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.check()
            except Exception:  # the watchdog must outlive any bug of its own
                logger.exception("watchdog check failed")

    def check(self) -> None:
        scheduler = self.scheduler
        scheduler.expire_waiting_from_outside()
        scheduler.cut_overdue_from_outside(self.late_by)
        if not scheduler.worker_alive:
            scheduler.mark_stalled(WORKER_DIED)  # nobody will ever answer what it held
            return
        busy = scheduler.busy()
        if busy is not None:
            since, stage = busy
            seconds = scheduler.clock() - since
            if seconds >= self.stall_timeout:
                scheduler.mark_stalled(f"a backend call in {stage} has not returned for {seconds:.0f}s "
                                       f"(limit {self.stall_timeout:g}s)", since)
