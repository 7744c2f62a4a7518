"""When an engine the server switched away from (upgrade.py) may be closed: once no HTTP request
that began while it served is still in flight.

Route code reads the serving engine (its tokenizer, its grammars) at any point of a request, so a
request that began before a switch may still hold the old engine; one that began after it cannot.
Requests are counted per engine generation; the switch sets the new engine first and then starts
the next generation, so a request counted in the new one can only ever have read the new engine.
"""
from __future__ import annotations

import threading
from collections import Counter


class EngineUsers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation = 0
        self._in_flight: Counter[int] = Counter()

    def enter(self) -> int:
        with self._lock:
            self._in_flight[self.generation] += 1
            return self.generation

    def leave(self, generation: int) -> None:
        with self._lock:
            self._in_flight[generation] -= 1
            if self._in_flight[generation] <= 0:
                del self._in_flight[generation]

    def next_generation(self) -> int:
        """Called right after the serving engine was replaced; returns the generation that ended."""
        with self._lock:
            self.generation += 1
            return self.generation - 1

    def done_with(self, generation: int) -> bool:
        """No request of `generation` or before is still in flight."""
        with self._lock:
            return not any(count > 0 for g, count in self._in_flight.items() if g <= generation)


class EngineUsersMiddleware:
    """Counts every HTTP request for its whole life (a streamed body included)."""

    def __init__(self, app, users: EngineUsers):
        self.app = app
        self.users = users

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        generation = self.users.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.users.leave(generation)
