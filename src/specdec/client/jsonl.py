"""The append-only JSONL record store under `specdec batch`'s results and `specdec bench`'s records.

One JSON object per line. `append` encodes a line whole before a byte is written, then writes,
flushes and fsyncs it, so a process killed at any moment loses at most the line it was writing.
Opening cuts that torn last line (no newline), so appending always starts on a fresh line. One
process appends at a time: the store holds an exclusive lock on the file (flock, where the OS has
it) from before it looks at the file until it is closed; the kernel drops the lock when the
process dies, SIGKILL included. What counts as a record and what a resumed run skips are the
caller's (client/batch.py, bench/records.py); `read_lines` gives them every line, parsed.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from specdec.types import SpecdecError

try:
    import fcntl
except ImportError:  # Windows: no advisory lock
    fcntl = None

RECORD_ERRORS = (ValueError, TypeError, RecursionError)  # what encoding a record that JSON cannot hold raises
UNREADABLE = object()  # the value of a line that is not JSON


@dataclass(frozen=True)
class Line:
    """One non-blank line of a JSONL file."""

    number: int  # 1-based, blank lines counted
    offset: int  # byte offset of its start
    value: object  # the parsed JSON, or UNREADABLE
    complete: bool  # ends with "\n" (a line without one was being written when its writer died)


def read_lines(path: Union[str, Path]) -> list[Line]:
    """Every non-blank line of a JSONL file, parsed; read-only. A missing file has none."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    raws = data.split(b"\n")  # the final element is what follows the last newline
    lines, offset = [], 0
    for index, raw in enumerate(raws):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            value = UNREADABLE
        lines.append(Line(index + 1, start, value, index < len(raws) - 1))
    return lines


def encode_record(record: dict) -> bytes:
    """One line: UTF-8 JSON, non-ASCII text as is. JSON has no NaN or infinity, so such a float
    (in a server's usage block, say) is written as null. A lone surrogate (U+D800..U+DFFF
    unpaired, which only a \\udXXX escape in JSON makes: an input id, a server's text) is not text
    UTF-8 can encode; it is written as that escape, "\\ud800", which JSON readers (Python's) read
    back to the same string, so an id still matches on a rerun. Raises one of RECORD_ERRORS when
    JSON cannot hold the record."""
    try:
        text = json.dumps(record, ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(record), ensure_ascii=False, allow_nan=False)
    # Only lone surrogates fail to encode, and only inside JSON strings: backslashreplace writes
    # each as exactly its JSON escape.
    return (text + "\n").encode("utf-8", "backslashreplace")


def _finite(value: object) -> object:
    """`value` with NaN and infinities replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def repair_torn_tail(path: Union[str, Path]) -> int:
    """Cut an unfinished last line (no trailing newline): the trace of a write that was killed.
    Returns the number of bytes removed."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        # Walk back to the last newline in blocks; the torn line is usually short.
        end, block = size, 1 << 16
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        else:
            keep = 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


class JsonlStore:
    """Appends records to `path` (see the module's docstring). Subclasses name their file in
    `busy_message`, the error when another process holds it."""

    busy_message = "another process is writing to {path}."

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        if fcntl is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._file.close()
                raise SpecdecError(self.busy_message.format(path=self.path)) from None
        self.dropped_bytes = repair_torn_tail(self.path)  # under the lock: no writer of ours is mid-line

    def append(self, record: dict) -> None:
        """Write one record's line; raises one of RECORD_ERRORS, having written nothing, when JSON
        cannot hold it (see `encode_record`)."""
        self._file.write(encode_record(record))
        self._file.flush()
        os.fsync(self._file.fileno())

    def cut(self, offset: int) -> None:
        """Drop everything from byte `offset` on: a last line the caller's rules call torn."""
        size = os.fstat(self._file.fileno()).st_size
        self._file.truncate(offset)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.dropped_bytes += max(0, size - offset)

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
