"""A resumable batch: JSONL requests in, one JSONL result line per request out, nothing lost.

Input lines hold `id` (a string or an integer, unique) and `messages` (chat) or `prompt`
(completions), plus optional per-line request fields (`max_tokens`, `temperature`, `stop`, ...)
that override the run's settings. `stream` and `stream_options` are the runner's to set. Lines end
at "\n" only (JSON Lines; a "\r" before it is dropped), so U+2028 and the like inside a string are text.

No poison items: a line that cannot become a request (see `read_input`) and a result that cannot be
written as JSON (see `unwritable_record`) each become an error record, and the run goes on.

Results are appended one line at a time, flushed and fsynced, by one run at a time (an exclusive
lock on the file). Opening the results file cuts a torn last line (a run killed mid-write), so
appending always starts on a fresh line (the shared JSONL store, client/jsonl.py). An id with a
successful line (`error` null) is done and skipped by a rerun; failed ids (and bad input lines)
are tried again and their new line is appended. So a run killed at any moment and rerun ends
with every id done exactly once, and the file holds the history (earlier failures stay, the
success is the line that counts).
"""
from __future__ import annotations

import asyncio
import codecs
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

from specdec.client.http import APIError, AsyncClient, Completion, request_fields, speculative_decoding_field
from specdec.client.jsonl import RECORD_ERRORS, JsonlStore, read_lines
from specdec.client.records import Layout, RequestRecord
from specdec.client.structured import check_output
from specdec.types import SpecdecError

RUNNER_FIELDS = ("stream", "stream_options")  # set by the runner, dropped from input lines
MAX_REPORTED_BAD_LINES = 3
MAX_INT_DIGITS = 100  # an integer in an input line has at most this many digits (ids, seeds, ...)
MAX_NESTING = 100  # arrays and objects in an input line nest at most this deep
# A string or a bracket; an unclosed string runs to the end, so the scan never restarts at each quote.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.S)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs valid escapes, so any left is lone


@dataclass(frozen=True)
class BatchItem:
    """One input line. `problem` says why the line cannot be sent; it is then recorded as failed."""

    id: Union[str, int, None]  # None: the line has no usable id; its records are keyed by line number
    line_no: int
    endpoint: Optional[str]  # "chat" | "completions"
    fields: dict = field(default_factory=dict)  # request fields of the line, messages/prompt included
    problem: Optional[str] = None

    @property
    def key(self) -> str:
        return id_key(self.id) if self.id is not None else line_key(self.line_no)


@dataclass(frozen=True)
class BatchSettings:
    """A batch run's request fields for every line (a line's own fields win, except
    `speculative_decoding` when `force_speculative`, as in compare mode) and how to send them."""

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


def line_key(line_no: int) -> str:
    """The key of an input line with no usable id; unquoted, so no id's key (a JSON string or integer) equals it."""
    return f"line {line_no}"


def record_key(record: dict) -> str:
    """The key a result line counts for: its id's, or its input line's when it has no id."""
    if record.get("id") is None and isinstance(record.get("line"), int):
        return line_key(record["line"])
    return id_key(record.get("id"))


# -- input ---------------------------------------------------------------------------------------------

def read_input(path: Union[str, Path]) -> list[BatchItem]:
    """Every request line of the input, in order. A line that cannot be a request becomes an item with
    a `problem` (one line naming the input line) that the run records as an error: not UTF-8, not
    JSON, an integer longer than MAX_INT_DIGITS, nesting deeper than MAX_NESTING, NaN or infinity,
    not an object, no usable id, a repeated id (these have id None), or an id but no valid
    messages/prompt. Reading stops, with one line naming the first bad lines, only when no line has
    a usable id (the wrong file, most likely)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecdecError(f"input file {path} not found.") from None
    except OSError as exc:
        raise SpecdecError(f"cannot read input file {path}: {exc}.") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    items, seen = [], {}
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if raw.strip(b" \t\r"):
            items.append(_line_item(raw, line_no, seen))
    if not any(item.id is not None for item in items):
        if not items:
            raise SpecdecError(f"input file {path} holds no requests.")
        more = f"; {len(items)} bad lines in all" if len(items) > MAX_REPORTED_BAD_LINES else ""
        raise SpecdecError(f"{path}: no line holds a request: "
                           + "; ".join(i.problem for i in items[:MAX_REPORTED_BAD_LINES]) + more + ".")
    return items


def parse_line(raw: bytes) -> tuple[object, Optional[str]]:
    """The JSON value of one input line, or (None, why not), the reason a predicate ("is not valid
    JSON (...)"). Integers and nesting are bounded before json sees them, so a 5000-digit number or
    10,000 nested brackets are a reason, not a ValueError or RecursionError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
    if _nests_deeper_than(text, MAX_NESTING):
        return None, f"nests arrays and objects more than {MAX_NESTING} deep"
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant), None
    except _BadNumber as exc:
        return None, str(exc)
    except json.JSONDecodeError as exc:
        return None, f"is not valid JSON ({exc.msg} at column {exc.colno})"
    except (ValueError, RecursionError) as exc:  # not expected past the bounds; still one line
        return None, f"cannot be read as JSON ({exc.__class__.__name__})"


class _BadNumber(Exception):
    """Raised from json.loads' number hooks: a number the runner does not take."""


def _bounded_int(digits: str) -> int:
    n_digits = len(digits.lstrip("-"))
    if n_digits > MAX_INT_DIGITS:
        raise _BadNumber(f"has an integer of {n_digits} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"has a number out of range ({text[:20]})")
    return value


def _no_constant(name: str) -> None:
    raise _BadNumber(f"has {name}, which is not JSON")


def _nests_deeper_than(text: str, limit: int) -> bool:
    """Whether arrays/objects nest deeper than `limit`, counting brackets outside strings.

    Example: '{"a": [[1]], "b": "[[[["}' nests 3 deep (the brackets in "b" are text).
    """
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token[0] == '"':
            continue
        if token in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _line_item(raw: bytes, line_no: int, seen: dict[str, int]) -> BatchItem:
    """The item of one non-blank input line; `seen` (id key -> line) finds repeated ids."""
    entry, problem = parse_line(raw)
    if problem is None and not isinstance(entry, dict):
        problem = "is not a JSON object"
    if problem is None:
        item_id = entry.get("id")
        if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or item_id == "":
            problem = "has no id (a non-empty string or an integer)"
        elif id_key(item_id) in seen:
            problem = f"repeats id {_show(item_id)} of line {seen[id_key(item_id)]}"
    if problem is not None:
        return BatchItem(None, line_no, None, {}, f"input line {line_no} {problem}")
    seen[id_key(item_id)] = line_no
    return _item(entry, line_no)


def _show(value: object, limit: int = 60) -> str:
    """repr on one line (lone surrogates escaped), cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
    elif _LONE_SURROGATE.search(json.dumps(fields, ensure_ascii=False)):
        problem = "the request holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which UTF-8 cannot send"
    else:
        problem = None
    endpoint = None if problem else ("chat" if has_messages else "completions")
    return BatchItem(entry["id"], line_no, endpoint, fields, problem and f"input line {line_no}: {problem}")


def request_body(item: BatchItem, settings: BatchSettings) -> dict:
    body = {"model": settings.model, **request_fields(settings.max_tokens, settings.temperature, settings.speculative),
            **item.fields}
    if settings.force_speculative and settings.speculative is not None:
        body["speculative_decoding"] = speculative_decoding_field(settings.speculative)
    return body


# -- results file ------------------------------------------------------------------------------------

def read_results(path: Union[str, Path]) -> tuple[list[dict], int]:
    """The records of a results file and the number of unreadable lines (a torn last line
    included); read-only. A missing file has no records."""
    lines = read_lines(path)
    records = [line.value for line in lines if isinstance(line.value, dict) and "id" in line.value]
    return records, len(lines) - len(records)


def usage_count(block: object, name: str) -> int:
    """A token count from a server's usage block; 0 where it is missing or not a count (a server's
    odd value must not sink the progress bar or the report, run after run)."""
    value = block.get(name) if isinstance(block, dict) else None
    if isinstance(value, float) and math.isfinite(value):
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def done_ids(records: Iterable[dict]) -> set[str]:
    return {record_key(r) for r in records if r.get("error") is None}


class ResultWriter(JsonlStore):
    """The results file of one run: the shared JSONL store (client/jsonl.py), so two runs cannot
    share a results file and a torn last line is cut on opening."""

    busy_message = "another batch is writing to {path}; wait for it or use another --out."


# -- running -----------------------------------------------------------------------------------------

RESULTS_LAYOUT = Layout(
    keys=("id", "line", "text", "usage", "latency_seconds", "ttft_seconds", "attempts", "error", "error_type", "model",
          "finish_reason", "speculative_decoding", "started_at", "finished_at", "schema_valid", "schema_error"),
    measured={"text": "text", "latency_seconds": "wall_seconds", "ttft_seconds": "ttft_seconds", "error": "error",
              "finish_reason": "finish_reason", "started_at": "started_at", "finished_at": "finished_at"},
)


def _identity(item: BatchItem, body: dict) -> dict:
    return {"id": item.id, "line": item.line_no, "model": body.get("model"),
            "speculative_decoding": body.get("speculative_decoding")}


def success_record(item: BatchItem, completion: Completion, body: dict, started_at: float) -> dict:
    valid, schema_error = check_output(completion.text, body.get("response_format"))
    checked = {"schema_valid": valid} if schema_error is None else {"schema_valid": valid, "schema_error": schema_error}
    return RequestRecord(
        text=completion.text, finish_reason=completion.finish_reason, wall_seconds=completion.latency_seconds,
        ttft_seconds=completion.ttft_seconds, started_at=started_at, finished_at=time.time(),
        fields={**_identity(item, body), "model": completion.model or body.get("model"), "usage": completion.usage,
                "attempts": [a.as_dict() for a in completion.attempts], "error_type": None,
                **checked},
    ).as_dict(RESULTS_LAYOUT)


def failure_record(item: BatchItem, error: str, error_type: str, attempts: list, body: dict,
                   started_at: float) -> dict:
    return RequestRecord(
        error=error, started_at=started_at, finished_at=time.time(),
        fields={**_identity(item, body), "usage": None, "attempts": attempts, "error_type": error_type},
    ).as_dict(RESULTS_LAYOUT)


def unwritable_record(item: BatchItem, record: dict, exc: BaseException, settings: BatchSettings) -> dict:
    """The error record written instead of a `record` that JSON cannot hold: the item counts as
    failed (a rerun sends it again) and the run goes on. Holds only the item's and the run's own
    values, so it always encodes."""
    reason = " ".join(f"{exc.__class__.__name__}: {exc}".split())[:200]
    return failure_record(item, f"the result of input line {item.line_no} cannot be written as JSON ({reason})",
                          "OutputError", [], request_body(item, settings), record.get("started_at") or time.time())


async def _send(client: AsyncClient, item: BatchItem, settings: BatchSettings) -> dict:
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


async def run_batch(client: AsyncClient, items: list[BatchItem], out_path: Union[str, Path], settings: BatchSettings,
                    progress: ProgressHook = ProgressHook()) -> RunOutcome:
    """Send every item not yet done in `out_path`, `settings.concurrency` at a time, appending one
    line per finished request."""
    if settings.concurrency < 1:
        raise SpecdecError("--concurrency must be at least 1.")
    writer = ResultWriter(out_path)  # locked, and a torn last line cut, before we read what is done
    try:
        done = done_ids(read_results(out_path)[0])
        pending = [item for item in items if item.key not in done]
        outcome = RunOutcome(pending=len(pending), skipped=len(items) - len(pending))
        progress.start(outcome.pending, outcome.skipped)
        queue = iter(pending)
        started = time.monotonic()

        async def worker() -> None:
            for item in queue:  # one shared iterator: each item goes to exactly one worker
                record = await _send(client, item, settings)
                try:
                    writer.append(record)
                except RECORD_ERRORS as exc:  # nothing was written: a line is encoded whole first
                    record = unwritable_record(item, record, exc, settings)
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
