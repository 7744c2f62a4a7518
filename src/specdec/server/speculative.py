"""The `speculative` extension of streamed chunks: who produced each token, and what each round
proposed (`stream_options: {"speculative": true}`; docs/server.md, "Token sources").

A chunk names the sources of the tokens whose text ends in it, so the playground can colour its
text; the text is cut one piece per token (pieces.TokenPieces) whatever the server's chunking.
Over a stream the sources hold exactly one entry per completion token: those of tokens whose text
was never sent (a stop string cut it) go on the finish_reason chunk. A round's entry goes on the
chunk that holds its last token (the target's own, which took the place of the first rejected
proposal), so a client shows a rejected proposal just before that chunk's text.

Asking for it undoes the one-token-per-chunk padding against an on-path observer (config.py): the
chunk's size now says what its sources say. A proposal's rejected text is text nobody generated:
from a history shared by every anonymous client (`--shared-history`), it is another client's, so
it is withheld there for the sources that draft from histories.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Protocol, Sequence

from specdec.server.protocol import SpeculativeChunk, SpeculativeRound, StreamOptions
from specdec.types import RoundOutcome, StreamEvent

NO_PROPOSAL = "none"  # a round's method when the target decoded one token alone (stats.py's choice name)


class PieceCutter(Protocol):
    def split_counted(self, text: str, token_ids: Sequence[int]) -> list[tuple[str, int]]: ...


def wants_rejected(options: Optional[StreamOptions]) -> Optional[bool]:
    """None: no extension asked; else whether the rejected proposals' text is asked too."""
    value = options.speculative if options is not None else None
    if value is None or value is False:
        return None
    return value is not True and bool(value.rejected)


class SourceAnnotator:
    """Cuts each event's text into per-token pieces, each with its `speculative` object.

    Example: a round that proposed "cat sat on" (draft) where the target kept "cat " and chose
    "mat" -> pieces "cat " (sources ["draft"]) and "mat" (sources ["target"], rounds [{"method":
    "draft", "proposed": 3, "accepted": 1, "rejected": "sat on"}] when asked)."""

    def __init__(self, pieces: PieceCutter, token_bytes: Callable[[int], bytes], rejected: bool,
                 hidden_sources: frozenset[str] = frozenset()):
        self._pieces = pieces
        self._token_bytes = token_bytes
        self._rejected = rejected
        self._hidden = hidden_sources  # sources whose rejected text is withheld
        self._sources: deque[str] = deque()  # of tokens received whose text is not sent yet
        self._rounds: deque[tuple[int, SpeculativeRound]] = deque()  # (tokens received by its end, round)
        self._received = 0
        self._sent = 0

    def split(self, event: StreamEvent) -> list[tuple[str, SpeculativeChunk]]:
        self._sources.extend(event.token_sources)
        self._received += len(event.token_ids)
        if event.round is not None:
            self._rounds.append((self._received, self._round(event.round)))
        return [(text, self._take(count)) for text, count in self._pieces.split_counted(event.text, event.token_ids)]

    def rest(self) -> SpeculativeChunk:
        """What no piece carried, for the finish_reason chunk."""
        return self._take(len(self._sources))

    def _take(self, count: int) -> SpeculativeChunk:
        sources = [self._sources.popleft() for _ in range(min(count, len(self._sources)))]
        self._sent += len(sources)
        rounds = []
        while self._rounds and self._rounds[0][0] <= self._sent:
            rounds.append(self._rounds.popleft()[1])
        return SpeculativeChunk(sources=sources, rounds=rounds)

    def _round(self, outcome: RoundOutcome) -> SpeculativeRound:
        rejected = None
        if self._rejected and outcome.rejected_token_ids and outcome.source not in self._hidden:
            data = b"".join(self._token_bytes(token) for token in outcome.rejected_token_ids)
            rejected = data.decode("utf-8", errors="replace")
        return SpeculativeRound(method=outcome.source or NO_PROPOSAL, proposed=outcome.proposed,
                                accepted=outcome.accepted, rejected=rejected)
