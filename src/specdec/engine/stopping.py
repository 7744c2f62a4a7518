"""Turning committed tokens into streamed text: whole UTF-8 characters only, stop strings honoured.

Text that could be the start of a stop string is held back until it is known not to be one, so a
stop string never leaks into the stream.
"""
from __future__ import annotations

import codecs
from typing import Sequence


class TextAssembler:
    def __init__(self, stop: Sequence[str] = ()):
        self.stop = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # decoded so far (incomplete UTF-8 sequences stay in the decoder)
        self.emitted = 0  # characters of self.text already streamed
        self.stopped = False

    def add(self, token_bytes: bytes) -> None:
        """Feed one token's bytes; sets `stopped` (and cuts the text) when a stop string completes."""
        before = len(self.text)
        self.text += self._decoder.decode(token_bytes)
        if self.stop:
            window_start = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True

    def finish(self) -> None:
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)

    def take_delta(self, final: bool = False) -> str:
        """Text safe to stream now: everything not yet streamed, minus a possible stop-string prefix."""
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._held_back()
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _held_back(self) -> int:
        longest = 0
        for s in self.stop:
            for length in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:length]):
                    longest = length
                    break
        return longest

