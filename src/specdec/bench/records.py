"""The record file: one JSON line per measured generation, written and flushed as it is produced.

A run that dies keeps every record written so far; at worst its last line is torn, and that line
is dropped when the file is opened again with resume. Records are keyed by
(prompt id, configuration label, repeat); resume runs only the keys not yet in the file. Appending,
locking and cutting are the shared JSONL store's (client/jsonl.py), as for `specdec batch`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from specdec.client.jsonl import JsonlStore, read_lines
from specdec.client.records import SUCCEEDED, Layout, RequestRecord
from specdec.types import SpecdecError

RECORDS_FILE = "records.jsonl"

RecordKey = tuple[str, str, int]  # (prompt_id, config, repeat)

RECORD_LAYOUT = Layout(
    keys=("source", "prompt_id", "category", "config", "method", "num_draft_tokens", "repeat", "success", "error",
          "prompt_tokens", "output_token_ids", "text", "finish_reason", "wall_seconds", "stats", "matches_off",
          "timings", "order", "started_at"),
    measured={"success": SUCCEEDED, "error": "error", "prompt_tokens": "prompt_tokens", "text": "text",
              "finish_reason": "finish_reason", "wall_seconds": "wall_seconds", "stats": "stats",
              "started_at": "started_at"},
    iso_times=True,
)


def bench_record(measured: RequestRecord, identity: dict, started_at: float) -> dict:
    """A records.jsonl line: whose generation it was (`identity`: source, prompt, configuration,
    repeat...), then what was measured; no token ids unless the measurement has them."""
    fields = {**identity, "output_token_ids": [], **measured.fields}
    return replace(measured, started_at=started_at, fields=fields).as_dict(RECORD_LAYOUT)


def record_key(record: dict) -> RecordKey:
    return (str(record["prompt_id"]), str(record["config"]), int(record["repeat"]))


def _is_record(value: object) -> bool:
    try:
        record_key(value)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


def read_records(path: Path) -> tuple[list[dict], Optional[int]]:
    """Every complete record, and the byte offset where a torn last line starts (None if none).

    The last line is torn when it lacks its newline or is not a whole record (the process died
    while writing it). A malformed line before the last means the file was edited: an error.
    """
    lines = read_lines(path)
    records: list[dict] = []
    for line in lines:
        if line is lines[-1] and not (line.complete and _is_record(line.value)):
            return records, line.offset
        if not _is_record(line.value):
            raise SpecdecError(f"{path}: line {line.number} is not a benchmark record; fix or remove it.")
        records.append(line.value)
    return records, None


class RecordFile(JsonlStore):
    """Appends records to `path`; with `resume`, first loads the records already there."""

    busy_message = "another benchmark is writing to {path}; wait for it or use another --out."

    def __init__(self, path: Path, resume: bool = False):
        path = Path(path)
        if path.exists() and path.stat().st_size > 0 and not resume:
            raise SpecdecError(
                f"{path} already holds records; pass --resume to continue that run, "
                "or choose another --out."
            )
        super().__init__(path)  # locked; a last line without its newline is cut
        try:
            self.records, torn_at = read_records(self.path)
        except BaseException:
            self.close()
            raise
        if torn_at is not None:  # a whole line that is not a record: a crash can leave one
            self.cut(torn_at)
        self.dropped_torn_line = self.dropped_bytes > 0
        self._by_key = {record_key(r): r for r in self.records}  # the last record of a key wins

    def __contains__(self, key: RecordKey) -> bool:
        return key in self._by_key

    def find(self, key: RecordKey) -> Optional[dict]:
        return self._by_key.get(key)

    def append(self, record: dict) -> None:
        super().append(record)
        self.records.append(record)
        self._by_key[record_key(record)] = record
