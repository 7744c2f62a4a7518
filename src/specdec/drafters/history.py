"""A cross-request n-gram cache: text the server generated before, as an extra draft source.

Support answers and code repeat boilerplate across requests ("Thank you for contacting ...",
`if __name__ == "__main__":`); the prompt-lookup drafter cannot see it because it lives in
earlier requests. Each tenant (API key) has its own bounded table, so one tenant's text never
drafts for another; the benchmark resets every table before each measured run.

A table maps the last `order` tokens to the `span` tokens that followed them most recently.
Example (order 2): after add([5, 6, 7, 8]), lookup([1, 5, 6], k=2) -> (7, 8).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Optional, Sequence

ANONYMOUS_TENANT = ""


class NgramHistory:
    """One tenant's table, bounded to `max_entries` n-grams (least recently written dropped first)."""

    def __init__(self, order: int = 3, span: int = 8, max_entries: int = 20_000):
        self.order = order
        self.span = span
        self.max_entries = max_entries
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember every n-gram of `tokens` and what followed it (at least one token)."""
        tokens = tuple(int(t) for t in tokens)
        with self._lock:
            for start in range(len(tokens) - self.order):
                key = tokens[start:start + self.order]
                self._table[key] = tokens[start + self.order:start + self.order + self.span]
                self._table.move_to_end(key)
            while len(self._table) > self.max_entries:
                self._table.popitem(last=False)

    def lookup(self, context: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the context's last `order` tokens before, or ()."""
        if k <= 0 or len(context) < self.order:
            return ()
        key = tuple(int(t) for t in context[-self.order:])
        with self._lock:
            return self._table.get(key, ())[:k]


class CrossRequestCache:
    """The tables of all tenants, at most `max_tenants` of them (least recently used dropped).
    At the defaults, 32 tenants x 20,000 n-grams: about 180 MB at most (soak, docs/server.md)."""

    def __init__(self, order: int = 3, span: int = 8, max_entries: int = 20_000, max_tenants: int = 32):
        self.order, self.span, self.max_entries, self.max_tenants = order, span, max_entries, max_tenants
        self._tenants: OrderedDict[str, NgramHistory] = OrderedDict()
        self._lock = threading.Lock()

    def for_tenant(self, tenant: Optional[str]) -> NgramHistory:
        key = tenant or ANONYMOUS_TENANT
        with self._lock:
            history = self._tenants.get(key)
            if history is None:
                history = self._tenants[key] = NgramHistory(self.order, self.span, self.max_entries)
                while len(self._tenants) > self.max_tenants:
                    self._tenants.popitem(last=False)
            self._tenants.move_to_end(key)
            return history

    def reset(self) -> None:
        with self._lock:
            self._tenants.clear()


def tenant_of_api_key(api_key: Optional[str]) -> str:
    """A stable tenant id for an API key that does not keep the key itself in memory."""
    if not api_key:
        return ANONYMOUS_TENANT
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]
