"""Prompt lookup (n-gram) drafting: no model, just text that repeats."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.drafters.base import Drafter
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


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Proposal:
        # A deterministic proposal: the acceptance rule treats it as a one-hot draft distribution.
        return Proposal(find_ngram_continuation(context, k, self.max_ngram, self.min_ngram), None, "ngram")
