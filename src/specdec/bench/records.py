"""The record file: one JSON line per measured generation, written and flushed as it is produced.

A run that dies keeps every record written so far; at worst its last line is torn, and that line
is dropped when the file is opened again with resume. Records are keyed by
(prompt id, configuration label, repeat); resume runs only the keys not yet in the file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from specdec.types import SpecdecError

RECORDS_FILE = "records.jsonl"

RecordKey = tuple[str, str, int]  # (prompt_id, config, repeat)


def record_key(record: dict) -> RecordKey:
    return (str(record["prompt_id"]), str(record["config"]), int(record["repeat"]))


def read_records(path: Path) -> tuple[list[dict], Optional[int]]:
    """Every complete record, and the byte offset where a torn last line starts (None if none).

    The last line is torn when it lacks its newline or is not a whole record (the process died
    while writing it). A malformed line before the last means the file was edited: an error.
    """
    data = Path(path).read_bytes()
    lines = data.split(b"\n")  # the final element is what follows the last newline
    records: list[dict] = []
    offset = 0
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for index, line in enumerate(lines):
        start = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        complete = index < len(lines) - 1  # followed by a newline
        try:
            record = json.loads(line)
            record_key(record)
        except (ValueError, KeyError, TypeError, AttributeError):
            record = None
        if index == last and (record is None or not complete):
            return records, start
        if record is None:
            raise SpecdecError(f"{path}: line {index + 1} is not a benchmark record; fix or remove it.")
        records.append(record)
    return records, None


class RecordFile:
    """Appends records to `path`; with `resume`, first loads the records already there."""

    def __init__(self, path: Path, resume: bool = False):
        self.path = Path(path)
        self.records: list[dict] = []
        self.dropped_torn_line = False
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise SpecdecError(
                    f"{self.path} already holds records; pass --resume to continue that run, "
                    "or choose another --out."
                )
            self.records, torn_at = read_records(self.path)
            if torn_at is not None:
                with open(self.path, "r+b") as f:
                    f.truncate(torn_at)
                self.dropped_torn_line = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._by_key = {record_key(r): r for r in self.records}  # the last record of a key wins
        self._file = open(self.path, "a", encoding="utf-8")

    def __contains__(self, key: RecordKey) -> bool:
        return key in self._by_key

    def find(self, key: RecordKey) -> Optional[dict]:
        return self._by_key.get(key)

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records.append(record)
        self._by_key[record_key(record)] = record

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "RecordFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
