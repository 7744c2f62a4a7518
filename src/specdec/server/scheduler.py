"""Continuous batching: one worker thread drives the engine core (engine/core.py) for every slot.

Each iteration the worker
  1. admits waiting requests while the core has a free slot (the core picks the slot whose cache
     shares the longest prefix with the prompt),
  2. aborts generations whose client went away, whose time is up or which something else ended
     (the watchdog, the drain), freeing their slots,
  3. runs one `core.step()`: prompt chunks, then every running generation's round in one shared
     target forward; and hands each request's items to its ticket.
A better build loaded beside the serving engine (upgrade.py) has its costs measured here, a pair
of forwards between two rounds, on the same thread (never beside a busy engine, whose threads would
share the cores); then new requests go to it while those already running finish on the old one,
whose core is stepped after the new one's until its last request is over.
This module keeps the queue, the tickets, the deadlines and the mapping of failures to errors; it
never reads a slot's cache. Events reach each request's asyncio queue through
`loop.call_soon_threadsafe`.

A backend call may never return; the worker then cannot keep time. The watchdog (watchdog.py)
does it from its own thread through the `*_from_outside` methods below, which touch only
tickets and the queue, never a generation or a backend.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator, Optional, cast

from specdec.backends.cost_model import CostModel
from specdec.engine import core
from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.engine_users import EngineUsers
from specdec.server.errors import APIError, bad_request
from specdec.server.recalibration import CostKeeper
from specdec.server.tickets import (
    CLIENT_GONE, INTERNAL_ERROR, Failed, QueueFull, Refused, Ticket, not_accepting_error, queue_timeout_error,
    shutting_down_error, stalled_error,
)
from specdec.server.watchdog import WORKER_DIED, Watchdog
from specdec.types import GenerationRequest, StreamEvent

if TYPE_CHECKING:
    from specdec.server.upgrade import BuildWatcher

logger = logging.getLogger("specdec.server")

@dataclass(frozen=True)
class Health:
    status: str  # "ok", "draining" or "unhealthy"
    reason: Optional[str] = None


@dataclass
class _Running:
    ticket: Ticket
    core: core.EngineCore  # the one it runs on: the serving engine's, or one a switch left behind
    handle: int  # that core's
    started: bool = False
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    tokens: int = 0  # generated so far


class Scheduler:
    def __init__(self, engine: Engine, config: ServerConfig, metrics=None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.core = engine.core
        self.n_slots = len(engine.slots)
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._reserved = 0  # queue places held by requests still being prepared (reserve())
        self._running: dict[tuple[core.EngineCore, int], _Running] = {}  # (core, its handle) -> its request
        self._draining = False
        self._stopping = False
        self._stalled: Optional[str] = None  # why the backend is deemed stuck; None while it answers
        self._busy: Optional[tuple[float, str]] = None  # (since, stage) while the worker is in an iteration
        self._thread: Optional[threading.Thread] = None
        self._watchdog: Optional[Watchdog] = None
        # A better build of the backend, loaded elsewhere (upgrade.py), to serve on once its costs
        # are measured (between rounds); the engines left behind (with the generation of requests
        # that may still hold them), stepped while requests run on them and closed once all are over.
        self._switch: Optional[Engine] = None
        self._measuring: Optional[Generator[None, None, CostModel]] = None  # the new build's costs, in steps
        self._build_watcher: Optional[BuildWatcher] = None
        self._retired: list[tuple[int, Engine]] = []
        self.users = EngineUsers()  # HTTP requests in flight per engine generation (the app counts them)
        self.engine_listeners: list[Callable[[Engine], None]] = []  # told of the engine switched to
        self.costs = CostKeeper(clock)  # auto's last good cost model; measured again at idle moments

    # -- called from the event loop ------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        with self._cond:
            return not self._waiting and not self._running

    def health(self) -> Health:
        if self._stalled is not None:
            return Health("unhealthy", self._stalled)
        if not self.worker_alive:
            return Health("unhealthy", WORKER_DIED)
        if self._draining:
            return Health("draining", "the server is shutting down and accepts no new requests")
        return Health("ok")

    @property
    def worker_alive(self) -> bool:
        """False once the worker thread has died (a bug); never while it is merely stuck."""
        return self._thread is None or self._thread.is_alive() or self._stopping

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)
        self._thread.start()
        self._watchdog = Watchdog(self, self.config.stall_timeout)
        self._watchdog.start()
        if self.config.switch_to_better_build:
            from specdec.server.upgrade import watch_for_build

            self._build_watcher = watch_for_build(self.engine, self.request_switch)

    def request_switch(self, engine: Engine) -> None:
        """Serve on `engine` (loaded) once the worker has measured its costs between rounds; the
        requests waiting then are its first, those running then finish on the old engine."""
        with self._cond:
            self._switch = engine
            self._cond.notify()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Ticket:
        return self.submit_many([request], loop)[0]

    def submit_many(self, requests: list[GenerationRequest], loop: asyncio.AbstractEventLoop,
                    reserved: int = 0) -> list[Ticket]:
        """Queue the requests (one per choice of an `n` > 1 request) together or none of them: the
        queue's bound counts each. `reserved`: the places reserve() held for them, given back now."""
        now = self.clock()
        tickets = [Ticket(request, loop, now, now + self.config.request_timeout, self._wake) for request in requests]
        with self._cond:
            self._reserved -= reserved
            self._check_accepting(len(tickets))
            self._waiting.extend(tickets)
            self._cond.notify()
        return tickets

    def reserve(self, count: int = 1) -> None:
        """Hold `count` places in the queue while a request is prepared (its prompt encoded), or
        raise Refused or QueueFull if it would be refused now: fifty requests sent at once are
        not all encoded when the queue takes a few of them. Given back by submit_many(reserved=)
        or unreserve()."""
        with self._cond:
            self._check_accepting(count)
            self._reserved += count

    def unreserve(self, count: int) -> None:
        with self._cond:
            self._reserved -= count

    def _check_accepting(self, count: int = 1) -> None:
        if self._stalled is not None:
            raise Refused(stalled_error(self._stalled))
        if self._draining or self._stopping:
            raise Refused(not_accepting_error())
        queued = len(self._waiting) + self._reserved
        if queued + count > self.config.max_queue + max(0, self.n_slots - len(self._running)):
            raise QueueFull()

    def begin_drain(self) -> None:
        """No new requests from now on; those in flight go on."""
        with self._cond:
            self._draining = True

    def abort_in_flight(self) -> None:
        """End every request still waiting or running with the `shutting_down` error (the drain's
        grace period is over); the worker frees their slots when it next looks."""
        self._fail_everything(shutting_down_error())

    def stop(self, timeout: float = 15.0) -> bool:
        """Cancel whatever is still in flight and end the worker; False if it is still inside a
        backend call after `timeout` seconds (then nobody may close the engine under it)."""
        with self._cond:
            self._draining = self._stopping = True
            self._cond.notify()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._build_watcher is not None:
            self._build_watcher.stop()
        return self.join(timeout)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the worker to end; True once it has (or never began)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- called from the watchdog's thread -----------------------------------------------------
    def busy(self) -> Optional[tuple[float, str]]:
        """(since, stage) of the worker's current iteration, or None while it waits for work."""
        busy = self._busy
        return None if busy is None else (busy[0], self.core.stage or busy[1])

    def expire_waiting_from_outside(self) -> None:
        """The queue-wait time limit and departed clients, for requests still waiting for a slot."""
        now = self.clock()
        gone = self._take_waiting(lambda t: t.cancelled)
        expired = self._take_waiting(lambda t: now >= t.deadline)
        for ticket in gone:
            ticket.post(Failed(CLIENT_GONE))
        for ticket in expired:
            ticket.timed_out = True
            ticket.post(Failed(self._timeout_error()))

    def cut_overdue_from_outside(self, late_by: float) -> None:
        """The time limit for running requests the worker has not cut `late_by` seconds after their
        deadline (it is inside a backend call): the stream ends as the worker would end it, with
        the text so far and finish_reason "length"; the worker frees the slot when it returns."""
        now = self.clock()
        with self._cond:
            overdue = [run for run in self._running.values()
                       if not run.ticket.closed and now >= run.ticket.deadline + late_by]
        for run in overdue:
            run.ticket.timed_out = True
            if run.started:
                run.ticket.post(StreamEvent("", [], "cancelled", run.core.stats_of(run.handle)))
            else:
                run.ticket.post(Failed(self._timeout_error()))

    def mark_stalled(self, reason: str, since: Optional[float] = None) -> None:
        """The backend has not returned for too long (in the iteration that began at `since`):
        report unhealthy, fail every request in flight, refuse new ones, until the worker comes
        back (then it recovers on its own)."""
        with self._cond:
            if self._stalled is not None:
                return
            if since is not None and (self._busy is None or self._busy[0] != since):
                return  # that iteration has just ended: nothing is stuck
            self._stalled = reason
        logger.error("backend stalled: %s; failing the requests in flight", reason)
        if self.metrics is not None:
            self.metrics.observe_stall()
        self._fail_everything(stalled_error(reason))

    def _fail_everything(self, error: APIError) -> None:
        waiting = self._take_waiting(lambda t: True)
        with self._cond:
            running = list(self._running.values())
        for ticket in waiting:
            ticket.post(Failed(error))
        for run in running:
            run.ticket.post(Failed(error))
        self._wake()

    def _take_waiting(self, leaves: Callable[[Ticket], bool]) -> list[Ticket]:
        """Remove from the queue, and return, the tickets for which `leaves` holds (one pass: a
        ticket's flags may change meanwhile)."""
        with self._cond:
            taken: list[Ticket] = []
            kept: deque[Ticket] = deque()
            for ticket in self._waiting:
                (taken if leaves(ticket) else kept).append(ticket)
            self._waiting = kept
            return taken

    # -- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running and not self._idle_work():
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    break
                recalibrate = (not self._waiting and not self._running and self._switch is None
                               and self.costs.due())
            if recalibrate:
                self._recalibrate()
            self._close_retired()
            for ticket in self._take_waiting(lambda t: t.cancelled or t.closed):
                ticket.post(Failed(CLIENT_GONE))  # dropped if the watchdog already ended it
            with self._cond:
                self._admit()
            try:
                self._busy = (self.clock(), "admitting")
                self._sweep()
                for stepped in self._cores_in_use():
                    for handle, item in stepped.step(self.config.prefill_chunk, self.config.batch_verify):
                        run = self._running.get((stepped, handle))
                        if run is not None:
                            self._hand_over(run, item)
                if self._switch is not None:
                    self._measure_new_build()
            except Exception:  # a bug of ours in an iteration: fail what is in flight, keep serving
                logger.exception("scheduler iteration failed")
                cores = self._cores_in_use()
                for run in list(self._running.values()):
                    self._release(run, error=INTERNAL_ERROR)
                for each in cores:
                    each.reset()
            finally:
                with self._cond:  # against mark_stalled: it sees this iteration running or ended
                    self._busy = None
                    stalled = self._stalled is not None
                if stalled:
                    self._recover()
        self._shut_down()

    def _recover(self) -> None:
        """The stuck call returned: its requests were already failed; serve again."""
        logger.warning("the backend answered again after a stall (%s); serving again", self._stalled)
        cores = self._cores_in_use()
        self._sweep()  # frees the slots of the requests failed meanwhile
        for each in cores:
            each.reset()  # whatever the stuck call left in the caches is not trusted
        with self._cond:
            self._stalled = None

    def _idle_work(self) -> bool:
        return (self._switch is not None or self.costs.due()
                or any(self.users.done_with(generation) for generation, _ in self._retired))

    def _cores_in_use(self) -> list[core.EngineCore]:
        """The serving engine's core, then any a switch left behind that still runs requests."""
        left_behind = {run.core for run in self._running.values()} - {self.core}
        return [self.core, *left_behind]

    def _measure_new_build(self) -> None:
        """One step of the new build's cost measurement (a pair of forwards on its free slot 0,
        between two rounds); after the last, the switch."""
        new = self._switch
        assert new is not None
        if self._measuring is None:
            self._measuring = new.cost_measurement(slot=0)
        measured: Optional[CostModel] = None
        self._busy = (self.clock(), "measuring the new build's costs")
        try:
            next(self._measuring)
            return
        except StopIteration as done:
            measured = done.value
        except Exception:
            logger.exception("measuring the new build's costs failed; it serves with the last build's meanwhile")
            new.core.reset()  # the measurement's scratch may be left in its slot
        self._switch_engine(new, measured)

    def _switch_engine(self, new: Engine, measured: Optional[CostModel]) -> None:
        """Serve on `new` from now on: new requests are its; running ones finish on the old core."""
        with self._cond:
            self._switch, self._measuring = None, None
        self.costs.adopt_new_build(new, self.engine, measured)
        old, self.engine, self.core = self.engine, new, new.core
        for listener in self.engine_listeners:
            listener(new)
        self._retired.append((self.users.next_generation(), old))  # after the listeners: see engine_users.py
        logger.info("serving on the new build (%d requests finish on the old one)", len(self._running))

    def _recalibrate(self) -> None:
        """Measure auto's costs again on a free slot; a request arriving meanwhile interrupts it."""
        self._busy = (self.clock(), "measuring the cost model again")
        try:
            self.costs.measure_again(self.engine, slot=0,
                                     interrupted=lambda: bool(self._waiting) or self._stopping or self._switch is not None)
        except Exception:
            logger.exception("measuring the cost model again failed; keeping the one in use")
            self.costs.due_at = None
        finally:
            with self._cond:
                self._busy = None

    def _close_retired(self) -> None:
        in_use = {run.core for run in self._running.values()}
        for generation, engine in [entry for entry in self._retired
                                   if self.users.done_with(entry[0]) and entry[1].core not in in_use]:
            self._retired.remove((generation, engine))
            engine.close()
            logger.info("closed the engine served before the switch: its last request is over")

    def _admit(self) -> None:
        """Free slots go to waiting requests in arrival order, except that a tenant holding more
        slots than another waiting tenant waits behind it (a fair share of the slots)."""
        while self._waiting and self.core.free_slots:
            holding: dict = {}
            for run in self._running.values():
                holding[run.ticket.request.tenant] = holding.get(run.ticket.request.tenant, 0) + 1
            ticket = min(self._waiting, key=lambda t: holding.get(t.request.tenant, 0))  # first of the fewest
            self._waiting.remove(ticket)
            handle = self.core.add(ticket.request)
            self._running[(self.core, handle)] = _Running(ticket, self.core, handle)

    def _sweep(self) -> None:
        """End the generations whose client left, whose time is up, or that someone else ended."""
        now = self.clock()
        for run in list(self._running.values()):
            ticket = run.ticket
            if not (ticket.cancelled or ticket.closed or now >= ticket.deadline):
                continue
            if not (ticket.cancelled or ticket.closed):
                ticket.timed_out = True
            final = run.core.abort(run.handle)
            if final is not None:
                # Its final event: the text so far, "length" on a time limit (dropped if already ended).
                self._deliver(run, final)
            else:
                self._release(run, error=self._timeout_error() if ticket.timed_out else CLIENT_GONE)

    def _hand_over(self, run: _Running, item: core.Item) -> None:
        if isinstance(item, core.Started):
            run.started = True
            run.ticket.post(item)
        elif isinstance(item, core.Failed):
            self._release(run, error=bad_request(str(item.error)) if item.bad_input else INTERNAL_ERROR)
        else:
            self._deliver(run, item)

    def _deliver(self, run: _Running, event: StreamEvent) -> None:
        if event.token_ids:
            now = self.clock()
            if run.first_token_at is None or run.last_token_at is None:
                run.first_token_at = now
                if self.metrics is not None:
                    self.metrics.observe_first_token(now - run.ticket.arrived)
            elif self.metrics is not None:
                self.metrics.observe_tokens(len(event.token_ids), now - run.last_token_at)
            run.last_token_at, run.tokens = now, run.tokens + len(event.token_ids)
        run.ticket.post(event)
        if event.finish_reason is not None:
            if self.metrics is not None:
                if run.tokens > 1 and run.first_token_at is not None and run.last_token_at is not None:
                    self.metrics.observe_time_per_output_token(
                        (run.last_token_at - run.first_token_at) / (run.tokens - 1))
                self.metrics.observe_finished(event.stats or {}, self._finish_reason(run, event),
                                              self.clock() - run.ticket.arrived)
            self._release(run)

    @staticmethod
    def _finish_reason(run: _Running, event: StreamEvent) -> str:
        """The metrics' name for how a generation ended: stop, length, timeout, abort or error."""
        if event.finish_reason != "cancelled":
            return cast(str, event.finish_reason)  # cast: a final event's (the caller checks)
        if run.ticket.failed is not None:
            return "error"  # a stall, or the drain's grace period: the client got an error
        return "timeout" if run.ticket.timed_out else "abort"

    def _release(self, run: _Running, error: Optional[APIError] = None) -> None:
        """The request is over here; the core frees its slot (already freed if it ended there)."""
        if error is not None:
            run.ticket.post(Failed(error))
        run.core.abort(run.handle)
        with self._cond:
            self._running.pop((run.core, run.handle), None)

    def _timeout_error(self) -> APIError:
        return queue_timeout_error(self.config.request_timeout, self.config.retry_after)

    def _shut_down(self) -> None:
        """The server is stopping: whatever is still in flight ends with the `shutting_down` error."""
        error = shutting_down_error()
        for ticket in self._take_waiting(lambda t: True):
            ticket.post(Failed(error))
        for run in list(self._running.values()):
            run.ticket.post(Failed(error))
            final = run.core.abort(run.handle)
            if final is not None:
                self._deliver(run, final)
            else:
                self._release(run)
