"""An assistant turn as the item-based APIs see it (Responses' output items, Messages' content
blocks): text blocks and tool-call blocks, each opened, grown and closed, in order.

The generated text goes through the one tool-call parser (tools.ToolStreamParser), piece by piece
for a stream or all at once for a whole answer, so both read the calls the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from specdec.server.tools import ToolCallDelta, ToolStreamParser


@dataclass
class Block:
    kind: str  # "text" or "call"
    index: int
    text: str = ""  # a text block's text, a call's arguments (JSON text)
    call_id: Optional[str] = None
    name: Optional[str] = None
    closed: bool = False

    def arguments_value(self) -> Any:
        """A call's arguments as the object they encode ({} for none; the text if it is no JSON)."""
        try:
            return json.loads(self.text) if self.text.strip() else {}
        except ValueError:
            return self.text


@dataclass(frozen=True)
class Opened:
    block: Block


@dataclass(frozen=True)
class Grew:
    block: Block
    delta: str


@dataclass(frozen=True)
class Closed:
    block: Block


BlockEvent = Union[Opened, Grew, Closed]


@dataclass
class Turn:
    """Feed it the generation's text; it says which blocks open, grow and close."""

    tool_names: frozenset[str]  # none: the output is text, not read for calls
    blocks: list[Block] = field(default_factory=list)

    def __post_init__(self):
        self._parser = ToolStreamParser(self.tool_names) if self.tool_names else None

    @property
    def calls(self) -> list[Block]:
        return [block for block in self.blocks if block.kind == "call"]

    def feed(self, text: str) -> list[BlockEvent]:
        if not text:
            return []
        items = self._parser.feed(text) if self._parser is not None else [text]
        return self._apply(items)

    def finish(self) -> list[BlockEvent]:
        events = self._apply(self._parser.finish() if self._parser is not None else [])
        return events + self._close_open()

    def _apply(self, items: list) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for item in items:
            current = self.blocks[-1] if self.blocks and not self.blocks[-1].closed else None
            if isinstance(item, str):
                if current is None or current.kind != "text":
                    events += self._close_open()
                    current = Block("text", len(self.blocks))
                    self.blocks.append(current)
                    events.append(Opened(current))
                current.text += item
                events.append(Grew(current, item))
            elif isinstance(item, ToolCallDelta):
                function = item.function
                if item.id is not None:  # a new call
                    events += self._close_open()
                    current = Block("call", len(self.blocks), call_id=item.id,
                                    name=function.name if function is not None else None)
                    self.blocks.append(current)
                    events.append(Opened(current))
                if current is not None and function is not None and function.arguments:
                    current.text += function.arguments
                    events.append(Grew(current, function.arguments))
        return events

    def _close_open(self) -> list[BlockEvent]:
        if self.blocks and not self.blocks[-1].closed:
            self.blocks[-1].closed = True
            return [Closed(self.blocks[-1])]
        return []


def stop_sequence_of(full_text: str, text: str, stop: tuple[str, ...]) -> Optional[str]:
    """Which stop string ended a generation whose kept text is `text` and whose tokens decode to
    `full_text` (the stop string is cut from the text, not from the tokens), or None."""
    rest = full_text[len(text):] if full_text.startswith(text) else ""
    for candidate in stop:
        if candidate and rest.startswith(candidate):
            return candidate
    return None
