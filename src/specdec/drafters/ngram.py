"""Prompt lookup (n-gram) drafting: no model, just text that repeats."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.drafters.base import Drafter
from specdec.drafters.suffix import SuffixIndex
from specdec.types import Proposal, SamplingParams


def find_ngram_continuation(context: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, ...]:
    """The k tokens that followed the most recent earlier occurrence of the context's last n tokens.

    Tries n = max_ngram down to min_ngram and returns the first continuation found.
    Example: context [1, 2, 3, 9, 1, 2], k=2, max_ngram=2 -> the suffix (1, 2) occurred at 0,
    followed by (3, 9) -> returns (3, 9).
    """
    if k <= 0:
        return ()
    tokens = np.asarray(context, dtype=np.int64)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        pattern = tokens[-n:]
        # Windows over tokens[:-1] start at 0..len-1-n, so each match has a continuation token.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == pattern).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tuple(int(t) for t in tokens[start:start + k])
    return ()


class NgramIndex:
    """find_ngram_continuation for a context that only grows between calls, at the cost of the new
    tokens alone (a SuffixIndex that answers with the latest occurrence): a scan of the whole
    context every round grows with it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._index = SuffixIndex(max_match=max_ngram, min_match=min_ngram)

    def reset(self) -> None:
        self._index.reset()

    def continuation(self, context: Sequence[int], k: int) -> tuple[int, ...]:
        """The same answer as find_ngram_continuation(context, k, max_ngram, min_ngram)."""
        return self.match(context, k)[1]

    def match(self, context: Sequence[int], k: int) -> tuple[int, tuple[int, ...]]:
        """(n, continuation): the longest n <= max_ngram whose last n tokens occurred before, and
        the k tokens that followed their latest occurrence; (0, ()) when none did.
        Example: context [5, 1, 2, 3, 9, 1, 2, 3], k 2 -> (3, (9, 1))."""
        if k <= 0:
            return 0, ()
        self._index.track(context)
        return self._index.latest(context, k)


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.index = NgramIndex(max_ngram, min_ngram)

    def begin(self, prompt, history=None) -> None:
        self.index.reset()

    def propose(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator, guide=None) -> Proposal:
        # A deterministic proposal: the acceptance rule treats it as a one-hot draft distribution.
        return Proposal(self.index.continuation(context, k), None, "ngram")
