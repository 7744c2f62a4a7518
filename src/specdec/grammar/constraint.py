"""One request's grammar state, with a tentative path for speculation.

The committed state is where the generated text stands. A round walks a tentative path from it
(the draft's tokens, then forced ones) and reads a mask at every state along it; the verdict
commits a prefix of the path (plus the target's own token) and the rest is rolled back.

Example: committed `{"a": `, path [`1`, `}`]: masks at `{"a": `, `{"a": 1`, `{"a": 1}`; the target
accepts `1` and picks `,` -> commit [`1`, `,`] (the `}` is rolled back, `,` consumed).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

MAX_FORCED_TOKENS = 16  # forced tokens proposed in one round (each costs a verification row)


class Constraint:
    def __init__(self, matcher, vocab_size: int, end_token_ids: frozenset[int]):
        self._matcher = matcher  # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self._end_ids = np.array(sorted(end_token_ids), dtype=np.int64)
        self._path: list[int] = []  # consumed beyond the committed state
        self._masks: dict[int, np.ndarray] = {}  # depth along the path -> allowed[vocab] (bool)

    # -- reading -------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """The grammar can take no more text at the committed state (only an end token)."""
        self._goto(())
        return self._matcher.is_stopped()

    def is_end(self, token: int) -> bool:
        return int(token) in self._end_ids

    def admissible(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the committed state, the grammar allows (end tokens never)."""
        tokens = [int(t) for t in tokens]
        for i, token in enumerate(tokens):
            if token in self._end_ids:
                tokens = tokens[:i]
                break
        common = self._common(tokens)
        return common + self._matcher_valid(tokens[common:], common)

    def allowed_after(self, tokens: Sequence[int]) -> np.ndarray:
        """allowed[vocab] at the state after committed text + `tokens` (which must be admissible)."""
        depth = len(tokens)
        self._stand_at(tokens)
        mask = self._masks.get(depth)
        if mask is None:
            mask = self._masks[depth] = self._fill()
        return mask

    def mask_logits(self, logits: np.ndarray, tokens: Sequence[int] = ()) -> np.ndarray:
        """A copy of one logits row with what the grammar forbids after `tokens` at -inf."""
        return np.where(self.allowed_after(tokens), logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def forced_after(self, tokens: Sequence[int], limit: int = MAX_FORCED_TOKENS) -> list[int]:
        """Tokens the grammar forces after `tokens` (at most `limit`): proposals whose acceptance is
        certain wherever exactly one token is allowed, and free wherever the proposal is verified."""
        self._stand_at(tokens)
        if limit <= 0 or self._matcher.is_stopped():
            return []
        forced = [int(t) for t in self._matcher.compute_ff_tokens()[:min(limit, MAX_FORCED_TOKENS)]]
        return forced[:self._matcher.validate_tokens(forced)]

    # -- moving ----------------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """The text moved on by `tokens` (an accepted prefix of the path plus the target's own
        token; end tokens are ignored): they become the committed state."""
        tokens = [int(t) for t in tokens if int(t) not in self._end_ids]
        self._goto(tokens)
        if len(self._path) != len(tokens):
            raise AssertionError("committed a token the grammar forbids")
        self._path = []
        self._masks = {0: self._masks[len(tokens)]} if len(tokens) in self._masks else {}

    # -- helpers -------------------------------------------------------------------------------
    def _common(self, tokens: Sequence[int]) -> int:
        common = 0
        for have, want in zip(self._path, tokens):
            if have != want:
                break
            common += 1
        return common

    def _matcher_valid(self, rest: list[int], common: int) -> int:
        self._rollback_to(common)
        return self._matcher.validate_tokens(rest) if rest else 0

    def _goto(self, tokens: Sequence[int]) -> None:
        """Stand at committed + tokens (consuming at most the admissible ones)."""
        tokens = [int(t) for t in tokens]
        common = self._common(tokens)
        self._rollback_to(common)
        rest = tokens[common:]
        if rest:
            valid = self._matcher.validate_tokens(rest)
            if valid and self._matcher.consume_tokens(rest[:valid]):
                self._path.extend(rest[:valid])

    def _stand_at(self, tokens: Sequence[int]) -> None:
        self._goto(tokens)
        if len(self._path) != len(tokens):
            raise AssertionError("a path the grammar forbids: cut proposals with admissible() first")

    def _rollback_to(self, depth: int) -> None:
        extra = len(self._path) - depth
        if extra > 0:
            self._matcher.rollback(extra)
            del self._path[depth:]
            for key in [key for key in self._masks if key > depth]:
                del self._masks[key]

    def _fill(self) -> np.ndarray:
        import llguidance.numpy as lnp

        bitmask = lnp.allocate_token_bitmask(1, self.vocab_size)
        lnp.fill_next_token_bitmask(self._matcher, bitmask, 0)
        allowed = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        if self._matcher.is_accepting():  # any of the model's end tokens ends the text, not only llguidance's one
            allowed[self._end_ids] = True
        return allowed
