"""A resumable batch: JSONL requests in, one JSONL result line per request out, nothing lost.

Input lines hold `id` (a string or an integer, unique) and `messages` (chat) or `prompt`
(completions), plus optional per-line request fields (`max_tokens`, `temperature`, `stop`, ...)
that override the run's settings. `stream` and `stream_options` are the runner's to set.

Results are appended one line at a time, flushed and fsynced, by one run at a time (an exclusive
lock on the file). Opening the results file cuts a torn last line (a run killed mid-write), so appending always starts on a fresh line. An id with a
successful line (`error` null) is done and skipped by a rerun; failed ids are sent again and their
new line is appended. So a run killed at any moment and rerun ends with every id done exactly once,
and the file holds the history (earlier failures stay, the success is the line that counts).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

from specdec.client.http import APIError, AsyncClient, Completion, request_fields, speculative_decoding_field
from specdec.types import SpecdecError

try:
    import fcntl
except ImportError:  # Windows: no advisory lock
    fcntl = None

RUNNER_FIELDS = ("stream", "stream_options")  # set by the runner, dropped from input lines
MAX_REPORTED_BAD_LINES = 3


@dataclass(frozen=True)
class BatchItem:
    """One input line. `problem` says why the line cannot be sent; it is then recorded as failed."""

    id: Union[str, int]
    line_no: int
    endpoint: Optional[str]  # "chat" | "completions"
    fields: dict = field(default_factory=dict)  # request fields of the line, messages/prompt included
    problem: Optional[str] = None


@dataclass(frozen=True)
class RunSettings:
    """Request fields for every line (a line's own fields win, except `speculative_decoding` when
    `force_speculative`, as in compare mode) and how to send them."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    speculative: Optional[str] = None  # on | off | a method name; None = the server's default
    force_speculative: bool = False
    concurrency: int = 1
    stream: bool = True  # stream to measure time to first token


@dataclass
class RunOutcome:
    pending: int = 0
    skipped: int = 0  # already done in the results file
    ok: int = 0
    failed: int = 0
    wall_seconds: float = 0.0


class ProgressHook:
    """Told when a run starts and after each result is on disk; the CLI draws a progress bar."""

    def start(self, pending: int, skipped: int) -> None:
        pass

    def result(self, record: dict) -> None:
        pass


def id_key(value: object) -> str:
    """A hashable key that keeps 1 and "1" apart."""
    return json.dumps(value)


# -- input ---------------------------------------------------------------------------------------------

def read_input(path: Union[str, Path]) -> list[BatchItem]:
    """Every request line of the input. Lines that cannot be identified (not JSON, no usable id, a
    repeated id) stop the run before anything is sent, with one line naming them; a line with an
    id but no valid messages/prompt becomes an item with a `problem`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecdecError(f"input file {path} not found.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"cannot read input file {path}: {exc}.") from None
    items, bad, seen = [], [], {}
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            bad.append(f"line {line_no} is not valid JSON ({exc.msg})")
            continue
        if not isinstance(entry, dict):
            bad.append(f"line {line_no} is not a JSON object")
            continue
        item_id = entry.get("id")
        if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or item_id == "":
            bad.append(f"line {line_no} has no id (a non-empty string or an integer)")
            continue
        key = id_key(item_id)
        if key in seen:
            bad.append(f"line {line_no} repeats id {item_id!r} of line {seen[key]}")
            continue
        seen[key] = line_no
        items.append(_item(entry, line_no))
    if bad:
        more = f"; {len(bad)} bad lines in all" if len(bad) > MAX_REPORTED_BAD_LINES else ""
        raise SpecdecError(f"{path}: " + "; ".join(bad[:MAX_REPORTED_BAD_LINES]) + more + ".")
    if not items:
        raise SpecdecError(f"input file {path} holds no requests.")
    return items


def _item(entry: dict, line_no: int) -> BatchItem:
    fields = {k: v for k, v in entry.items() if k != "id" and k not in RUNNER_FIELDS}
    has_messages, has_prompt = "messages" in fields, "prompt" in fields
    if has_messages == has_prompt:
        problem = "a line needs exactly one of messages or prompt"
    elif has_messages and not (isinstance(fields["messages"], list) and fields["messages"]
                               and all(isinstance(m, dict) for m in fields["messages"])):
        problem = "messages must be a non-empty list of message objects"
    elif has_prompt and not isinstance(fields["prompt"], (str, list)):
        problem = "prompt must be a string or a list"
    else:
        problem = None
    endpoint = None if problem else ("chat" if has_messages else "completions")
    return BatchItem(entry["id"], line_no, endpoint, fields, problem and f"input line {line_no}: {problem}")


def request_body(item: BatchItem, settings: RunSettings) -> dict:
    body = {"model": settings.model, **request_fields(settings.max_tokens, settings.temperature, settings.speculative),
            **item.fields}
    if settings.force_speculative and settings.speculative is not None:
        body["speculative_decoding"] = speculative_decoding_field(settings.speculative)
    return body


# -- results file ------------------------------------------------------------------------------------

def read_results(path: Union[str, Path]) -> tuple[list[dict], int]:
    """The records of a results file and the number of unreadable lines (a torn last line
    included); read-only. A missing file has no records."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return [], 0
    records, unreadable = [], 0
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            unreadable += 1
            continue
        if isinstance(record, dict) and "id" in record:
            records.append(record)
        else:
            unreadable += 1
    return records, unreadable


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


def done_ids(records: Iterable[dict]) -> set[str]:
    return {id_key(r["id"]) for r in records if r.get("error") is None}


class ResultWriter:
    """Appends result lines, each one flushed and fsynced before the next request's line. Holds an
    exclusive lock on the file (where the OS has flock), so two runs cannot share a results file;
    the kernel drops the lock when the process dies, SIGKILL included."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if fcntl is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._file.close()
                raise SpecdecError(f"another batch is writing to {self.path}; wait for it or use another --out.") from None

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


# -- running -----------------------------------------------------------------------------------------

def success_record(item: BatchItem, completion: Completion, body: dict, started_at: float) -> dict:
    return {
        "id": item.id, "text": completion.text, "usage": completion.usage,
        "latency_seconds": completion.latency_seconds, "ttft_seconds": completion.ttft_seconds,
        "attempts": [a.as_dict() for a in completion.attempts], "error": None, "error_type": None,
        "model": completion.model or body.get("model"), "finish_reason": completion.finish_reason,
        "speculative_decoding": body.get("speculative_decoding"), "started_at": started_at,
        "finished_at": time.time(),
    }


def failure_record(item: BatchItem, error: str, error_type: str, attempts: list, body: dict,
                   started_at: float) -> dict:
    return {
        "id": item.id, "text": None, "usage": None, "latency_seconds": None, "ttft_seconds": None,
        "attempts": attempts, "error": error, "error_type": error_type, "model": body.get("model"),
        "finish_reason": None, "speculative_decoding": body.get("speculative_decoding"), "started_at": started_at,
        "finished_at": time.time(),
    }


async def _send(client: AsyncClient, item: BatchItem, settings: RunSettings) -> dict:
    """The result line of one item. Never raises for a failed request: the failure is the record."""
    started_at = time.time()
    body = request_body(item, settings)
    if item.problem:
        return failure_record(item, item.problem, "InputError", [], body, started_at)
    try:
        completion = await client.create(item.endpoint, body, stream=settings.stream)
    except APIError as exc:
        return failure_record(item, str(exc), exc.__class__.__name__, [a.as_dict() for a in exc.attempts],
                              body, started_at)
    except Exception as exc:  # a record, not a crash that would lose the rest of the batch
        return failure_record(item, f"{exc.__class__.__name__}: {exc}", exc.__class__.__name__, [], body,
                              started_at)
    return success_record(item, completion, body, started_at)


async def run_batch(client: AsyncClient, items: list[BatchItem], out_path: Union[str, Path], settings: RunSettings,
                    progress: ProgressHook = ProgressHook()) -> RunOutcome:
    """Send every item not yet done in `out_path`, `settings.concurrency` at a time, appending one
    line per finished request."""
    if settings.concurrency < 1:
        raise SpecdecError("--concurrency must be at least 1.")
    writer = ResultWriter(out_path)  # locked before we read what is done
    try:
        repair_torn_tail(out_path)
        done = done_ids(read_results(out_path)[0])
        pending = [item for item in items if id_key(item.id) not in done]
        outcome = RunOutcome(pending=len(pending), skipped=len(items) - len(pending))
        progress.start(outcome.pending, outcome.skipped)
        queue = iter(pending)
        started = time.monotonic()

        async def worker() -> None:
            for item in queue:  # one shared iterator: each item goes to exactly one worker
                record = await _send(client, item, settings)
                writer.append(record)
                if record["error"] is None:
                    outcome.ok += 1
                else:
                    outcome.failed += 1
                progress.result(record)

        await asyncio.gather(*(worker() for _ in range(min(settings.concurrency, max(1, len(pending))))))
        outcome.wall_seconds = time.monotonic() - started
    finally:
        writer.close()
    return outcome
