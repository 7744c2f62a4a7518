"""A cross-request history: text a tenant sent and got before, as an extra draft source.

Support answers and code repeat boilerplate across requests ("Thank you for contacting ...",
`if __name__ == "__main__":`), and a tenant's prompts share templates; the request's own prompt
lookup cannot see them because they live in earlier requests. Each tenant has its own bounded
suffix index over its recent requests (prompt and output each), so one tenant's text never drafts
for another. The server's tenants are the tenants of its API keys (server/tenants.py); without
keys its requests share nothing unless it runs with --shared-history. The benchmark resets every
history before each measured run unless asked to give it the earlier prompts of the run
(`specdec bench --tenant-history`).

Matches shorter than `min_match` tokens are not looked for: between different requests they
rarely hold (Spec-Bench, prompts 6-15 per category: see drafters/auto.py's CACHE_PRIORS).
Example (min_match 2): after add([5, 6, 7, 8]), continuation([1, 5, 6], k=2).tokens -> (7, 8).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Optional, Sequence

from specdec.drafters.suffix import Continuation, SuffixIndex

ANONYMOUS_TENANT = ""  # tenant None: the one history every anonymous request shares (the benchmark's)
# A request that must share nothing (an anonymous client of a server without keys): it gets an
# empty history of its own, never kept, so it drafts from no earlier request and none from it.
UNSHARED_TENANT = "\x00unshared"


class TenantHistory:
    """One tenant's recent requests, at most `max_tokens` tokens (the oldest requests dropped first)."""

    def __init__(self, min_match: int = 4, max_match: int = 16, max_tokens: int = 16_384):
        self.max_tokens = max_tokens
        self._index = SuffixIndex(max_match=max_match, min_match=min_match, key_max=min_match, max_tokens=max_tokens)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tokens held."""
        return len(self._index)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one request's tokens (its prompt and output) as a sequence of their own."""
        with self._lock:
            self._index.add_sequence(list(tokens)[-self.max_tokens:])

    def continuation(self, context: Sequence[int], k: int) -> Continuation:
        """Up to k tokens that followed the context's longest matched suffix in earlier requests."""
        with self._lock:
            return self._index.continuation(context, k)

    def candidates(self, context: Sequence[int], k: int) -> list[tuple[int, ...]]:
        """SuffixIndex.candidates over this history."""
        with self._lock:
            return self._index.candidates(context, k)


class CrossRequestCache:
    """The histories of all tenants, at most `max_tenants` of them (least recently used dropped)."""

    def __init__(self, max_tokens: int = 16_384, max_tenants: int = 32):
        self.max_tokens, self.max_tenants = max_tokens, max_tenants
        self._tenants: OrderedDict[str, TenantHistory] = OrderedDict()
        self._lock = threading.Lock()

    def for_tenant(self, tenant: Optional[str]) -> TenantHistory:
        if tenant == UNSHARED_TENANT:
            return TenantHistory(max_tokens=self.max_tokens)
        key = tenant or ANONYMOUS_TENANT
        with self._lock:
            history = self._tenants.get(key)
            if history is None:
                history = self._tenants[key] = TenantHistory(max_tokens=self.max_tokens)
                while len(self._tenants) > self.max_tenants:
                    self._tenants.popitem(last=False)
            self._tenants.move_to_end(key)
            return history

    def reset(self) -> None:
        with self._lock:
            self._tenants.clear()

    def sizes(self) -> tuple[int, int]:
        """(tenants, tokens their histories hold together)."""
        with self._lock:
            histories = list(self._tenants.values())
        return len(histories), sum(len(history) for history in histories)


def tenant_of_api_key(api_key: Optional[str]) -> str:
    """A stable tenant id for an API key that does not keep the key itself in memory."""
    if not api_key:
        return ANONYMOUS_TENANT
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]
