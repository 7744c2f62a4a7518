"""Fake backends with the timing of a real one, and one that can hang.

`TimedFakeBackend` sleeps like a CPU forward: a fixed cost per call plus a cost per evaluated row
(decode rows dearer than prompt rows), with a batch of sequences (`eval_many`) paying the fixed
cost once. `HangingBackend` blocks its next forward until released: a backend call that never
returns, for the watchdog's tests.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Sequence

from specdec.backends.fake import FakeBackend


class TimedFakeBackend(FakeBackend):
    def __init__(self, forward_seconds: float = 0.0, row_seconds: float = 0.0, prompt_row_seconds: float = 0.0,
                 **fake):
        super().__init__(**fake)
        # FakeBackend records every call for tests; in a long-running server that record would be
        # the one thing growing (a soak measured it), so keep only the latest calls.
        self.eval_calls = deque(maxlen=10_000)
        self.forward_seconds = forward_seconds
        self.row_seconds = row_seconds
        self.prompt_row_seconds = prompt_row_seconds

    def _spend(self, rows: int, prefill: bool) -> None:
        seconds = self.forward_seconds + rows * (self.prompt_row_seconds if prefill else self.row_seconds)
        if seconds > 0:
            time.sleep(seconds)

    def eval(self, seq_id: int, start: int, tokens: Sequence[int], *, prefill: bool = False):
        self._spend(len(tokens), prefill)
        return super().eval(seq_id, start, tokens, prefill=prefill)

    def eval_many(self, requests, *, prefill: bool = False):
        self._spend(sum(len(tokens) for _, _, tokens in requests), prefill)
        rows = []
        for seq_id, start, tokens in requests:
            rows.append(FakeBackend.eval(self, seq_id, start, tokens, prefill=prefill))
        return rows


class HangingBackend(TimedFakeBackend):
    """`hang()` makes the next forward block until `release()`; `stuck` is set once one blocks."""

    def __init__(self, **timed):
        super().__init__(**timed)
        self._open = threading.Event()
        self._open.set()
        self.stuck = threading.Event()

    def hang(self) -> None:
        self.stuck.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def _spend(self, rows: int, prefill: bool) -> None:
        if not self._open.is_set():
            self.stuck.set()
            self._open.wait()
        super()._spend(rows, prefill)
