"""One sequence's KV cache on one backend, tracked as the list of tokens it holds.

Rollback is a length: truncate(n) drops positions n.. from the backend and from the list.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.backends.base import Backend


class CachedSequence:
    def __init__(self, backend: Backend, seq_id: int = 0):
        self.backend = backend
        self.seq_id = seq_id
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):
            self.backend.truncate(self.seq_id, length)
            del self.tokens[length:]

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest cached prefix of `tokens` (prefix caching); returns its length."""
        common = 0
        for cached, wanted in zip(self.tokens, tokens):
            if cached != wanted:
                break
            common += 1
        self.truncate(common)
        return common

    def prefill(self, tokens: Sequence[int]) -> int:
        """Bring the cache to exactly `tokens`, reusing what is already cached; no logits.
        Returns how many tokens were reused."""
        common = self.reuse_prefix(tokens)
        rest = list(tokens[common:])
        if rest:
            self.backend.eval(self.seq_id, common, rest, prefill=True)
            self.tokens.extend(rest)
        return common

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Append tokens and return their logits [len(tokens), vocab]."""
        logits = self.backend.eval(self.seq_id, len(self.tokens), list(tokens))
        self.tokens.extend(tokens)
        return logits

    def record(self, tokens: Sequence[int]) -> None:
        """Note tokens that a batched call (Backend.eval_many) appended to this sequence's cache."""
        self.tokens.extend(tokens)

    def clear(self) -> None:
        """Empty the cache, also of positions that another holder of this seq_id left behind."""
        self.backend.truncate(self.seq_id, 0)
        self.tokens.clear()
