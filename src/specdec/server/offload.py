"""Request work done off the event loop (templates, tokenizers, grammar checks, the JSON of big
bodies and answers): a few jobs at a time, the places shared fairly between tenants.

Every such job wants Python's GIL, and the event loop waits its turn behind each of them: with
anyio's default of 40 worker threads, 50 requests sent at once kept /health from answering within
a second on a busy 2-core machine (the soak, docs/server.md). Here at most `places` jobs run at once
(the machine's cores, 2 to 4), the others wait on the loop, where waiting costs nothing, and a place
that frees goes to the tenants in turn, so a tenant that sends fifty requests at once delays
another tenant's next one by a job at most, not by fifty.
"""
from __future__ import annotations

import asyncio
import functools
import os
import weakref
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Hashable, Optional, TypeVar

import anyio.to_thread

T = TypeVar("T")
ANONYMOUS = ("anonymous",)  # the fairness key of a request without a tenant


def default_places() -> int:
    return max(2, min(4, os.cpu_count() or 2))


class FairLimiter:
    """At most `places` holders at once; a freed place goes to the next tenant in turn (round
    robin over the tenants that wait, each tenant's own requests first come, first served)."""

    def __init__(self, places: int):
        self.places = places
        self.busy = 0
        self._waiting: OrderedDict[Hashable, deque[asyncio.Future]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    @asynccontextmanager
    async def place(self, tenant: Hashable) -> AsyncIterator[None]:
        if self.busy < self.places and not self._waiting:
            self.busy += 1
        else:
            granted = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(tenant, deque()).append(granted)
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():  # given a place, then cancelled: pass it on
                    self._release()
                else:
                    self._forget(tenant, granted)
                raise
        try:
            yield
        finally:
            self._release()

    def _forget(self, tenant: Hashable, granted: asyncio.Future) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self._waiting[tenant]

    def _release(self) -> None:
        """Hand the place to the first waiter of the tenant whose turn it is, or free it."""
        while self._waiting:
            tenant, queue = next(iter(self._waiting.items()))
            granted = queue.popleft()
            if queue:
                self._waiting.move_to_end(tenant)  # its next request waits for the other tenants' turns
            else:
                del self._waiting[tenant]
            if not granted.done():
                granted.set_result(None)
                return
        self.busy -= 1


_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FairLimiter] = weakref.WeakKeyDictionary()


def limiter() -> FairLimiter:
    """The running event loop's limiter (one per loop: a server's, or a test's)."""
    loop = asyncio.get_running_loop()
    found = _limiters.get(loop)
    if found is None:
        found = _limiters[loop] = FairLimiter(default_places())
    return found


async def off_loop(function: Callable[..., T], *args, tenant: Optional[Hashable] = None,
                   abandon_on_cancel: bool = False) -> T:
    """function(*args) in a worker thread, once this tenant's turn gives it a place."""
    async with limiter().place(ANONYMOUS if tenant is None else tenant):
        return await anyio.to_thread.run_sync(functools.partial(function, *args), abandon_on_cancel=abandon_on_cancel)
