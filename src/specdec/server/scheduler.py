"""Continuous batching: one worker thread owns the engine and serves every slot at once.

Each iteration the worker
  1. admits waiting requests into free slots, choosing the slot whose cache shares the longest
     prefix with the new prompt (prefix caching: a chat's history or a common system prompt is
     not processed again),
  2. cancels generations whose client went away or whose time is up, freeing their slots,
  3. prefills prompts in chunks of at most `prefill_chunk` tokens per iteration, so a long prompt
     joining does not stall the others,
  4. asks every running generation for its plan (pending token + drafts) and verifies all of
     them in ONE batched target forward (`Backend.eval_many`), then commits each.
Events reach each request's asyncio queue through `loop.call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Union

from specdec.engine.decoder import Generation
from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.errors import APIError, bad_request
from specdec.types import GenerationRequest, SpecdecError, StreamEvent

logger = logging.getLogger("specdec.server")


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


@dataclass(frozen=True)
class Started:
    """The prompt is processed; tokens follow."""

    prompt_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Failed:
    error: APIError


Item = Union[Started, StreamEvent, Failed]

# Answers a request whose client went away before its generation started (nobody reads it; it
# ends the request's coroutine). 499 is the status proxies use for "client closed request".
INTERNAL_ERROR = APIError(500, "internal error while generating.", "server_error", None, "internal_error")
CLIENT_GONE = APIError(499, "the client closed the request.", "invalid_request_error", None, "client_closed_request")


class Ticket:
    """One request's place in the scheduler. The request's coroutine reads `next()`; it may call
    `cancel()` (client gone) from the event loop; the worker posts events from its thread."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, arrived: float, deadline: float,
                 wake: Callable[[], None]):
        self.request = request
        self.loop = loop
        self.arrived = arrived
        self.deadline = deadline
        self.cancelled = False
        self.timed_out = False
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._wake = wake

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._wake()

    async def next(self) -> Item:
        return await self._queue.get()

    def post(self, item: Item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


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
        self._thread: Optional[threading.Thread] = None

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

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Ticket:
        now = self.clock()
        ticket = Ticket(request, loop, now, now + self.config.request_timeout, self._wake)
        with self._cond:
            if self._draining or self._stopping:
                raise Draining()
            free_slots = len(self.engine.slots) - len(self._running)
            if len(self._waiting) >= self.config.max_queue + max(0, free_slots):
                raise QueueFull()
            self._waiting.append(ticket)
            self._cond.notify()
        return ticket

    def begin_drain(self) -> None:
        """No new requests from now on; those in flight go on."""
        with self._cond:
            self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel whatever is still in flight and end the worker."""
        with self._cond:
            self._draining = self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    break
                gone, expired = self._drop_waiting()
                admitted = self._admit()
            for ticket in gone:
                ticket.post(Failed(CLIENT_GONE))
            for ticket in expired:
                ticket.post(Failed(self._timeout_error()))
            try:
                for run in admitted:
                    self._guarded(run, self._begin, run)
                self._sweep()
                self._prefill()
                self._decode()
            except Exception:  # a backend failure in a batched forward: fail what is in flight, keep serving
                logger.exception("scheduler iteration failed")
                for run in list(self._running.values()):
                    self._release(run, error=INTERNAL_ERROR, reset=True)
        self._shut_down()

    def _drop_waiting(self) -> tuple[list[Ticket], list[Ticket]]:
        """Take out of the queue the requests whose client went away and those past their deadline."""
        now = self.clock()
        gone = [t for t in self._waiting if t.cancelled]
        expired = [t for t in self._waiting if not t.cancelled and now >= t.deadline]
        if gone or expired:
            self._waiting = deque(t for t in self._waiting if not t.cancelled and now < t.deadline)
        return gone, expired

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
        run.generation = self.engine.new_generation(request, slot=run.slot)
        run.admitted_at = self.engine.clock()
        if self.engine.config.prefix_cache:
            run.cached_prompt_tokens = self.engine.slots[run.slot].target.reuse_prefix(request.prompt_token_ids[:-1])

    def _sweep(self) -> None:
        now = self.clock()
        for run in list(self._running.values()):
            ticket = run.ticket
            if not ticket.cancelled and now < ticket.deadline:
                continue
            ticket.timed_out = not ticket.cancelled
            if run.started and run.generation is not None:
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
        return len(self.engine.slots[run.slot].target.tokens) >= len(run.ticket.request.prompt_token_ids) - 1

    def _prefill_chunk(self, run: _Running, budget: int) -> int:
        """Process up to `budget` more prompt tokens of this slot; returns how many."""
        prefix = run.ticket.request.prompt_token_ids[:-1]
        slot = self.engine.slots[run.slot]
        done = len(slot.target.tokens)
        end = min(len(prefix), done + budget)
        alignment = slot.target.alignment
        if end < len(prefix) and alignment > 1:
            end = max(done, end // alignment * alignment)  # chunks are processed whole (sequence.py)
        if end > done:
            slot.target.prefill(prefix[:end])
        if run.ticket.request.spec.method == "draft" and slot.draft is not None:
            slot.draft.prefill(prefix[:end])
        return end - done

    def _start(self, run: _Running) -> None:
        generation = run.generation
        # The chunked prefill above is part of this generation's prompt processing.
        generation.start(started_at=run.admitted_at, cached_prompt_tokens=run.cached_prompt_tokens)
        run.started = True
        run.ticket.post(Started(len(run.ticket.request.prompt_token_ids), run.cached_prompt_tokens))
        if generation.finished:  # nothing to generate (max_tokens 0): cancel() returns its final event
            self._deliver(run, generation.cancel())

    def _decode(self) -> None:
        batch, plans = [], []
        for run in [run for run in self._running.values() if run.started and not run.generation.finished]:
            tokens = self._guarded(run, run.generation.plan)  # drafting: per sequence
            if tokens is not None:
                batch.append(run)
                plans.append(tokens)
        if not batch:
            return
        requests = [(run.generation.target.seq_id, len(run.generation.target.tokens), tokens)
                    for run, tokens in zip(batch, plans)]
        target = self.engine.target
        clock = self.engine.clock
        if self.config.batch_verify:
            t0 = clock()
            rows = target.eval_many(requests)
            seconds = [clock() - t0] * len(batch)
        else:
            rows, seconds = [], []
            for request in requests:
                t0 = clock()
                rows.append(target.eval(*request))
                seconds.append(clock() - t0)
        for run, tokens, logits, spent in zip(batch, plans, rows, seconds):
            generation = run.generation
            generation.target.record(tokens)
            generation.stats.verify_seconds += spent
            alone = len(batch) == 1 or not self.config.batch_verify  # a batched forward times no one sequence
            self._deliver(run, generation.commit(logits, spent if alone else None))

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
        if event.finish_reason == "cancelled":
            return "timeout" if run.ticket.timed_out else "abort"
        return event.finish_reason

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
        return APIError(503, f"the request waited past the server's time limit of {self.config.request_timeout:g}s "
                             "before it could start; retry later.", "server_error", None, "timeout",
                        {"Retry-After": str(self.config.retry_after)})

    def _shut_down(self) -> None:
        error = APIError(503, "the server is shutting down.", "server_error", None, "shutting_down")
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for ticket in waiting:
            ticket.post(Failed(error))
        for run in list(self._running.values()):
            if run.started and run.generation is not None and not run.generation.finished:
                run.ticket.timed_out = True
                self._deliver(run, run.generation.cancel())
            else:
                self._release(run, error=error)
