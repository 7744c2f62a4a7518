"""One measured request, whoever sent it: `specdec batch` (client/batch.py) and the benchmark's
engine, peer and served records (bench/runner.py, bench/peers.py, bench/serving.py).

A `RequestRecord` holds what is measured of every request (text, tokens, finish reason, error,
timings, the engine's or server's own statistics) under one set of names, and in `fields` what
its producer adds (identity such as prompt id and configuration, or id and input line; attempts,
token ids...). Each file names the measured part its own way, fixed by its `Layout`, so files
written before keep reading: `as_dict(layout)` writes a file's line, `from_dict` reads one back.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Mapping, Optional, Sequence

SUCCEEDED = "succeeded"  # a layout key mapped here holds `error is None`, written and never read back


@dataclass(frozen=True)
class StreamTiming:
    ttft_seconds: Optional[float]
    decode_tokens_per_second: Optional[float]


def stream_timing(chunks: Sequence[tuple[float, int]], started: float, tokens: int) -> StreamTiming:
    """Time to first token and decode tokens/s of a token stream.

    `chunks` are the (arrival time, tokens) of each chunk that carried generated text (a chunk of an
    HTTP stream counts 1 token: its count is unknown); `tokens` is the whole completion's count.
    TTFT runs from `started` to the first chunk; decode tokens/s counts the tokens after the first
    chunk over the time from the first chunk to the last, so the trailing usage event is no part of it.
    Example: started 10.0, chunks at 10.5 (1 token), 10.7 (2), 11.5 (3), 6 tokens -> TTFT 0.5 s,
    (6 - 1) / (11.5 - 10.5) = 5 tokens/s.
    """
    if not chunks:
        return StreamTiming(None, None)
    (first, first_tokens), last = chunks[0], chunks[-1][0]
    later = tokens - first_tokens
    decode = later / (last - first) if len(chunks) > 1 and last > first and later > 0 else None
    return StreamTiming(first - started, decode)


@dataclass(frozen=True)
class Layout:
    """How one file writes a record: its keys in order, and which of them hold a measured field
    (file key -> RequestRecord field, or SUCCEEDED). A producer's own key not in `keys` comes last."""

    keys: tuple[str, ...]
    measured: Mapping[str, str]
    iso_times: bool = False  # started_at as an ISO 8601 string to the second, else Unix seconds


@dataclass(frozen=True)
class RequestRecord:
    text: Optional[str] = None
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    wall_seconds: Optional[float] = None
    ttft_seconds: Optional[float] = None
    decode_tokens_per_second: Optional[float] = None
    started_at: Optional[float] = None  # Unix seconds
    finished_at: Optional[float] = None
    stats: Optional[dict] = None  # the engine's or the server's own statistics, speculative counts included
    fields: Mapping[str, object] = field(default_factory=dict)  # the producer's own keys, written as they are

    @property
    def succeeded(self) -> bool:
        return self.error is None

    def with_fields(self, **more: object) -> "RequestRecord":
        return replace(self, fields={**self.fields, **more})

    def as_dict(self, layout: Layout) -> dict:
        values = {key: getattr(self, name) for key, name in layout.measured.items()}
        if layout.iso_times and "started_at" in values:
            values["started_at"] = _iso(values["started_at"])
        values.update(self.fields)
        ordered = {key: values.pop(key) for key in layout.keys if key in values}
        return {**ordered, **values}

    @classmethod
    def from_dict(cls, line: Mapping[str, object], layout: Layout) -> "RequestRecord":
        measured = {name: line.get(key) for key, name in layout.measured.items() if name != SUCCEEDED}
        if layout.iso_times and isinstance(measured.get("started_at"), str):
            measured["started_at"] = datetime.fromisoformat(measured["started_at"]).timestamp()
        own = {key: value for key, value in line.items() if key not in layout.measured}
        return cls(**measured, fields=own)


def _iso(seconds: Optional[float]) -> Optional[str]:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")
