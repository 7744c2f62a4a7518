"""Cutting a stream's text into one piece per token (every surface's streams use it)."""
from __future__ import annotations

import codecs
from collections import deque
from typing import Callable, Sequence


class TokenPieces:
    """Cuts a stream's text into one piece per token, so that a chunk's size does not say how
    many drafted tokens its decoding step accepted (arXiv 2411.01076).

    The pieces are cut from the events' own text, so they concatenate to exactly what the engine
    streams (stop strings cut, text held back for a possible stop string sent later); the tokens'
    bytes, decoded as the engine decodes them (stopping.py), only say where the cuts fall. A token
    whose bytes end inside a UTF-8 character ends no piece: the character goes with the token that
    completes it, so no piece holds a broken character.

    Example: one event with tokens "the ", b"\xc3", b"\xa9", "!" and text "the é!" -> pieces
    "the ", "é", "!" (b"\xc3" alone decodes to nothing).
    """

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoded = 0  # characters the tokens so far decode to
        # Where tokens' text ends (characters from the start), not yet passed, each with how many
        # tokens end there (a token that completes no character counts with the one that does).
        self._ends: deque[tuple[int, int]] = deque()
        self._streamed = 0  # characters of the stream's text cut so far
        self._unended = 0  # tokens since the last end
        self._passed = 0  # tokens of ends passed without a piece of their own, for the next piece

    def split(self, text: str, token_ids: Sequence[int]) -> list[str]:
        return [piece for piece, _ in self.split_counted(text, token_ids)]

    def split_counted(self, text: str, token_ids: Sequence[int]) -> list[tuple[str, int]]:
        """The pieces, each with the number of tokens whose text ends in it (speculative.py)."""
        for token in token_ids:
            added = len(self._decoder.decode(self._token_bytes(token)))
            self._unended += 1
            if added:
                self._decoded += added
                self._ends.append((self._decoded, self._unended))
                self._unended = 0
        start, end, pieces = self._streamed, self._streamed + len(text), []
        cut = start
        while self._ends and self._ends[0][0] <= end:
            boundary, count = self._ends.popleft()
            self._passed += count
            if boundary > cut:
                pieces.append((text[cut - start:boundary - start], self._passed))
                cut, self._passed = boundary, 0
        if cut < end:  # text past the last token end: the start of a token held back, or the final flush
            pieces.append((text[cut - start:], 0))
        self._streamed = end
        return pieces
