"""One sequence's KV cache on one backend, tracked as the list of tokens it holds.

Rollback is a length: truncate(n) drops positions n.. from the backend and from the list.

Prefix caching is exact only if a reused position holds what processing the new prompt from
scratch would have put there. On a backend whose numbers depend on the batch a position was
computed in (`prefill_alignment` > 1, e.g. llama.cpp in exact mode), a sequence made with
`aligned_reuse` therefore reuses only whole prompt chunks: positions that prompt processing
computed in full aligned chunks, never positions a decode step or a partial last chunk computed.
Another sequence of the same backend may take those positions too (adopt), where the backend
lets sequences share cached positions: another slot's in whole blocks of the backend's
prefix_share_block, a parked start's (engine/prompt_cache.py) as far as its slot would have kept
them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specdec.backends.base import Backend


class CachedSequence:
    def __init__(self, backend: Backend, seq_id: int = 0, aligned_reuse: bool = False):
        self.backend = backend
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.alignment = backend.prefill_alignment if aligned_reuse else 1
        # alignment > 1 only: the whole chunks that prompt processing computed, and where it ended
        # (its partial last chunk serves only a prompt of exactly that length)
        self._whole_chunks_end = 0
        self._prefill_end = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):
            self.backend.truncate(self.seq_id, length)
            del self.tokens[length:]
        self._whole_chunks_end = min(self._whole_chunks_end, length)
        if length < self._prefill_end:
            self._prefill_end = 0

    def reusable_prefix(self, tokens: Sequence[int]) -> int:
        """How much of `tokens` the cache can serve: the common prefix, cut to whole chunks."""
        common = reusable_length(self.tokens, tokens, self.alignment, self._whole_chunks_end, self._prefill_end)
        return self.backend.keepable(self.seq_id, common)

    @property
    def reusable_end(self) -> int:
        """Where the positions a longer prompt may reuse end: those that prompt processing
        computed in whole chunks (all it holds where alignment is 1)."""
        return self._whole_chunks_end if self.alignment > 1 else len(self.tokens)

    def restorable(self) -> int:
        """How many of its first positions some later prompt may reuse (reusable_prefix): its
        whole prompt chunks, or all of its last prompt, which serves that very prompt again."""
        return max(self.reusable_end, self._prefill_end)

    def shareable_prefix(self, tokens: Sequence[int]) -> int:
        """How much of `tokens` another sequence may take from this cache: computed by prompt
        processing in whole chunks, cut to whole blocks of the backend's prefix_share_block."""
        if not self.backend.prefix_share_block:
            return 0
        common = common_prefix_length(self.tokens, tokens)
        if self.alignment > 1:
            common = min(common, self._whole_chunks_end)
        unit = math.lcm(self.backend.prefix_share_block, self.alignment)
        return common // unit * unit

    def adopt(self, source: "CachedSequence", length: int) -> None:
        """Hold `source`'s first `length` positions (its shareable_prefix, or up to its restorable()
        length) instead of what this holds, reusable as far as they were in `source`."""
        self.clear()
        self.backend.share_prefix(source.seq_id, self.seq_id, length)
        self.tokens = source.tokens[:length]
        self._whole_chunks_end = min(length, source._whole_chunks_end) if source.alignment > 1 else length
        self._prefill_end = length if length == source._prefill_end else 0  # the source's very prompt

    def save(self) -> "SavedSequence | None":
        """A copy in host memory of the positions a later prompt may reuse (restorable()), or None
        where the backend cannot copy its cache out."""
        length = self.restorable()
        cells = self.backend.save_positions(self.seq_id, length) if length else None
        if cells is None:
            return None
        return SavedSequence(tuple(self.tokens[:length]), self.alignment, min(self._whole_chunks_end, length),
                             self._prefill_end if self._prefill_end == length else 0, cells)

    def load(self, saved: "SavedSequence", length: int) -> None:
        """Hold the first `length` positions of `saved` (at most its reusable_prefix of a prompt)
        instead of what this holds, as if this sequence had computed them: the same cells' values."""
        self.clear()
        self.backend.load_positions(self.seq_id, saved.cells, length)
        self.tokens = list(saved.tokens[:length])
        self._whole_chunks_end = min(length, saved.whole_chunks_end)
        self._prefill_end = length if length == saved.prefill_end else 0

    def gather(self, end: int) -> bool:
        """Move what this holds into cells that lie together, with room for positions < end
        (Backend.gather); whether it moved. A move that fails leaves it empty, then raises."""
        try:
            return bool(self.tokens) and self.backend.gather(self.seq_id, len(self.tokens), end)
        except BaseException:
            self.clear()
            raise

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the reusable cached prefix of `tokens` (prefix caching); returns its length."""
        common = self.reusable_prefix(tokens)
        self.truncate(common)
        return self.backend.keepable(self.seq_id, common)

    def prefill(self, tokens: Sequence[int]) -> int:
        """Bring the cache to exactly `tokens`, reusing what is already cached; no logits.
        Returns how many tokens were reused."""
        common = self.reuse_prefix(tokens)
        rest = list(tokens[common:])
        if rest:
            self.backend.eval(self.seq_id, common, rest, prefill=True)
            self.tokens.extend(rest)
        if self.alignment > 1 and rest:
            # Processing started on a chunk boundary, so every full chunk up to here is canonical.
            self._whole_chunks_end = len(tokens) // self.alignment * self.alignment
            self._prefill_end = len(tokens)
        return self.backend.keepable(self.seq_id, common)

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
        self._whole_chunks_end = self._prefill_end = 0


@dataclass(frozen=True)
class SavedSequence:
    """A sequence's reusable positions copied to host memory (CachedSequence.save)."""

    tokens: tuple[int, ...]
    alignment: int
    whole_chunks_end: int
    prefill_end: int  # the length of the prompt it was, where all of it was saved; else 0
    cells: np.ndarray  # the backend's copy of their cells (uint8)

    def reusable_prefix(self, tokens: Sequence[int]) -> int:
        return reusable_length(self.tokens, tokens, self.alignment, self.whole_chunks_end, self.prefill_end)


def reusable_length(held: Sequence[int], tokens: Sequence[int], alignment: int, whole_chunks_end: int,
                    prefill_end: int) -> int:
    """How much of `tokens` positions computed for `held` serve exactly: the common prefix, cut to
    the whole chunks prompt processing computed, or all of the very prompt processed the same way."""
    common = common_prefix_length(held, tokens)
    if alignment > 1:
        if common >= len(tokens) == prefill_end:
            return common
        common = min(common, whole_chunks_end) // alignment * alignment
    return common


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    return common
