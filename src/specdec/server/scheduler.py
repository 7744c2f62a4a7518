"""Continuous batching: one worker thread owns the engine and serves every slot at once.

Each iteration the worker
  1. admits waiting requests into free slots, choosing the slot whose cache shares the longest
     prefix with the new prompt (prefix caching: a chat's history or a common system prompt is
     not processed again),
  2. cancels generations whose client went away, whose time is up or which something else ended
     (the watchdog, the drain), freeing their slots,
  3. prefills prompts in chunks of at most `prefill_chunk` tokens per iteration, so a long prompt
     joining does not stall the others,
  4. asks every running generation for its plan (pending token + drafts) and verifies all of
     them in ONE batched target forward (`Backend.eval_many`), then commits each.
The engine work of these steps is engine/batch.py's; this module keeps the queue, the tickets,
the deadlines and the mapping of failures to errors.
Events reach each request's asyncio queue through `loop.call_soon_threadsafe`.

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
from typing import Callable, Optional

from specdec.engine import batch
from specdec.engine.decoder import Generation
from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.errors import APIError, bad_request
from specdec.server.tickets import (
    CLIENT_GONE, INTERNAL_ERROR, Failed, QueueFull, Refused, Started, Ticket, not_accepting_error,
    queue_timeout_error, shutting_down_error, stalled_error,
)
from specdec.server.watchdog import WORKER_DIED, Watchdog
from specdec.types import GenerationRequest, SpecdecError, StreamEvent

logger = logging.getLogger("specdec.server")


@dataclass(frozen=True)
class Health:
    status: str  # "ok", "draining" or "unhealthy"
    reason: Optional[str] = None


@dataclass
class _Running:
    ticket: Ticket
    slot: int
    generation: Optional[Generation] = None
    admitted_at: float = 0.0  # engine clock
    cached_prompt_tokens: int = 0
    started: bool = False
    first_token_at: Optional[float] = None


class Scheduler:
    def __init__(self, engine: Engine, config: ServerConfig, metrics=None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._running: dict[int, _Running] = {}  # slot index -> its generation
        self._last_used = [0.0] * len(engine.slots)
        self._draining = False
        self._stopping = False
        self._stalled: Optional[str] = None  # why the backend is deemed stuck; None while it answers
        self._busy: Optional[tuple[float, str]] = None  # (since, stage) while the worker is in an iteration
        self._thread: Optional[threading.Thread] = None
        self._watchdog = None

    # -- called from the event loop ------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy_slots(self) -> list[int]:
        with self._cond:
            return sorted(self._running)

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

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Ticket:
        now = self.clock()
        ticket = Ticket(request, loop, now, now + self.config.request_timeout, self._wake)
        with self._cond:
            self._check_accepting()
            free_slots = len(self.engine.slots) - len(self._running)
            if len(self._waiting) >= self.config.max_queue + max(0, free_slots):
                raise QueueFull()
            self._waiting.append(ticket)
            self._cond.notify()
        return ticket

    def check_accepting(self) -> None:
        """Raise Refused if a new request would be refused now (checked before a prompt is encoded)."""
        with self._cond:
            self._check_accepting()

    def _check_accepting(self) -> None:
        if self._stalled is not None:
            raise Refused(stalled_error(self._stalled))
        if self._draining or self._stopping:
            raise Refused(not_accepting_error())

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
        return self._busy

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
            if run.started and run.generation is not None:
                run.ticket.post(StreamEvent("", [], "cancelled", _stats_snapshot(run.generation)))
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
            taken, kept = [], deque()
            for ticket in self._waiting:
                (taken if leaves(ticket) else kept).append(ticket)
            self._waiting = kept
            return taken

    # -- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    break
            for ticket in self._take_waiting(lambda t: t.cancelled or t.closed):
                ticket.post(Failed(CLIENT_GONE))  # dropped if the watchdog already ended it
            with self._cond:
                admitted = self._admit()
            try:
                self._busy = (self.clock(), "admitting")
                for run in admitted:
                    self._guarded(run, self._begin, run)
                self._sweep()
                self._busy = (self._busy[0], "prompt processing")
                self._prefill()
                self._busy = (self._busy[0], "decoding")
                self._decode()
            except Exception:  # a backend failure in a batched forward: fail what is in flight, keep serving
                logger.exception("scheduler iteration failed")
                for run in list(self._running.values()):
                    self._release(run, error=INTERNAL_ERROR, reset=True)
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
        stuck_slots = list(self._running)
        self._sweep()  # frees the slots of the requests failed meanwhile
        for slot in stuck_slots:
            self._reset_slot(slot)  # whatever the stuck call left in their caches is not trusted
        with self._cond:
            self._stalled = None

    def _admit(self) -> list[_Running]:
        admitted = []
        while self._waiting and len(self._running) < len(self.engine.slots):
            ticket = self._waiting.popleft()
            prompt = ticket.request.prompt_token_ids[:-1]
            free = [i for i in range(len(self.engine.slots)) if i not in self._running]
            slot = max(free, key=lambda i: (self.engine.slots[i].target.reusable_prefix(prompt),
                                            -self._last_used[i]))
            run = self._running[slot] = _Running(ticket, slot)
            admitted.append(run)
        return admitted

    def _guarded(self, run: _Running, stage: Callable, *args):
        """Run one request's stage; if it fails, only that request fails (400 for bad input)."""
        try:
            return stage(*args)
        except SpecdecError as exc:
            self._release(run, error=bad_request(str(exc)), reset=True)
        except Exception:
            logger.exception("generation failed in %s", getattr(stage, "__name__", "a stage"))
            self._release(run, error=INTERNAL_ERROR, reset=True)
        return None

    def _begin(self, run: _Running) -> None:
        request = run.ticket.request
        run.generation, run.admitted_at, run.cached_prompt_tokens = batch.begin(self.engine, request, run.slot)

    def _sweep(self) -> None:
        """End the generations whose client left, whose time is up, or that someone else ended."""
        now = self.clock()
        for run in list(self._running.values()):
            ticket = run.ticket
            if not (ticket.cancelled or ticket.closed or now >= ticket.deadline):
                continue
            if not (ticket.cancelled or ticket.closed):
                ticket.timed_out = True
            if run.started and run.generation is not None:
                # Its final event: the text so far, "length" on a time limit (dropped if already ended).
                self._deliver(run, run.generation.cancel())
            else:
                self._release(run, error=self._timeout_error() if ticket.timed_out else CLIENT_GONE)

    def _prefill(self) -> None:
        budget = self.config.prefill_chunk
        for run in list(self._running.values()):
            if run.started or run.generation is None:
                continue
            if self.engine.config.prefix_cache:
                if budget <= 0:
                    break
                budget -= self._guarded(run, self._prefill_chunk, run, budget) or 0
                if run.slot not in self._running or not self._prefilled(run):
                    continue
            self._guarded(run, self._start, run)

    def _prefilled(self, run: _Running) -> bool:
        return batch.prompt_done(self.engine, run.slot, run.ticket.request)

    def _prefill_chunk(self, run: _Running, budget: int) -> int:
        return batch.prefill_chunk(self.engine, run.slot, run.ticket.request, budget)

    def _start(self, run: _Running) -> None:
        generation = run.generation
        # The chunked prefill above is part of this generation's prompt processing.
        generation.start(started_at=run.admitted_at, cached_prompt_tokens=run.cached_prompt_tokens)
        run.started = True
        run.ticket.post(Started(len(run.ticket.request.prompt_token_ids), run.cached_prompt_tokens))
        if generation.finished:  # nothing to generate (max_tokens 0): cancel() returns its final event
            self._deliver(run, generation.cancel())

    def _decode(self) -> None:
        running, plans = [], []
        for run in [run for run in self._running.values() if run.started and not run.generation.finished]:
            tokens = self._guarded(run, run.generation.plan)  # drafting: per sequence
            if tokens is not None:
                running.append(run)
                plans.append(tokens)
        if not running:
            return
        events = batch.verify_batch(self.engine, [run.generation for run in running], plans, self.config.batch_verify)
        for run, event in zip(running, events):  # each delivered as soon as it is committed
            self._deliver(run, event)

    def _deliver(self, run: _Running, event: StreamEvent) -> None:
        if event.token_ids and run.first_token_at is None:
            run.first_token_at = self.clock()
            if self.metrics is not None:
                self.metrics.observe_first_token(run.first_token_at - run.ticket.arrived)
        run.ticket.post(event)
        if event.finish_reason is not None:
            if self.metrics is not None:
                self.metrics.observe_finished(event.stats or {}, self._finish_reason(run, event),
                                              self.clock() - run.ticket.arrived)
            self._release(run)

    @staticmethod
    def _finish_reason(run: _Running, event: StreamEvent) -> str:
        """The metrics' name for how a generation ended: stop, length, timeout, abort or error."""
        if event.finish_reason != "cancelled":
            return event.finish_reason
        if run.ticket.failed is not None:
            return "error"  # a stall, or the drain's grace period: the client got an error
        return "timeout" if run.ticket.timed_out else "abort"

    def _release(self, run: _Running, error: Optional[APIError] = None, reset: bool = False) -> None:
        if error is not None:
            run.ticket.post(Failed(error))
        if reset:
            self._reset_slot(run.slot)
        with self._cond:
            self._running.pop(run.slot, None)
            self._last_used[run.slot] = self.clock()

    def _reset_slot(self, index: int) -> None:
        """Forget a slot's caches after a failure left them in an unknown state."""
        slot = self.engine.slots[index]
        for sequence in (slot.target, slot.draft):
            if sequence is not None:
                try:
                    sequence.clear()
                except Exception:
                    logger.exception("could not reset slot %d", index)
                    sequence.tokens.clear()

    def _timeout_error(self) -> APIError:
        return queue_timeout_error(self.config.request_timeout, self.config.retry_after)

    def _shut_down(self) -> None:
        """The server is stopping: whatever is still in flight ends with the `shutting_down` error."""
        error = shutting_down_error()
        for ticket in self._take_waiting(lambda t: True):
            ticket.post(Failed(error))
        for run in list(self._running.values()):
            run.ticket.post(Failed(error))
            if run.started and run.generation is not None and not run.generation.finished:
                self._deliver(run, run.generation.cancel())
            else:
                self._release(run)


def _stats_snapshot(generation: Generation) -> dict:
    """A generation's statistics read from another thread while the worker is stuck in a backend
    call (so nothing is changing them); {} in the unlikely case they change under us."""
    try:
        return generation.stats.as_dict()
    except RuntimeError:
        return {}
