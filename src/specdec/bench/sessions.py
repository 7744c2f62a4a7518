"""`specdec bench --sessions N`: replayed multi-turn sessions through HTTP, specdec beside llama-server.

The sessions ship with specdec (data/sessions/*.json): a coding agent (reads a source file, edits
a function, reads the test output, fixes it), a support chat (a long fixed policy system prompt,
many short turns) and a document assistant (a long document, several questions). Each file holds
a system prompt, optional tools and the user turns, fixed text; the assistant's replies are what
the server under test generates in this replay (greedy, --max-tokens per turn), so the
conversation grows with the model's own answers, as it does for a user. `--sessions N` cycles
through them, each session with its own first line (`Conversation reference: KIND-NNN.`), so
prefixes differ across sessions and repeat within one.

Every turn is a streamed chat completion with `cache_prompt: true`, and `prompt_cache_key` and
`user` naming the session, so a server may keep the conversation. At each level of
`--session-concurrency` that many sessions are open at once (each with at most one turn in flight;
the next session opens when one ends), and at most as many requests as the server has slots
(the highest `--concurrency`) are sent at once: with more sessions open than slots, the open
sessions' turns interleave (FIFO) and a session's next turn usually finds its slot taken by
another conversation; the wait for a slot is the client's (`queued_seconds`), never part of TTFT.

Every server runs alone: for each (repeat, level) each configuration gets a freshly started
server (one `specdec serve --parallel SLOTS` per method; one llama-server `-np SLOTS` per
`--session-peer-specs` entry; both with the same `--cache-ram`), warmed up by one short unrelated request, then
stopped; the order of configurations alternates. A fresh server has an empty prompt cache, so
every block starts cold. Records (session-records.jsonl) are bench/serving.py's `_stream`
requests; the report (session-report.md/.json) gives per configuration and level the median and
IQR of turn time, TTFT of first and of later turns, decode tok/s and session total time, the
share of later turns' prompt tokens the server reported cached, and how many turns' texts equal
the same session replayed alone (level 1, repeat 0) on specdec's `off` and on the configuration
itself; every differing turn is listed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import httpx

from specdec.bench.serving import ServedConfig, _stream, served_model
from specdec.client.records import Layout, RequestRecord
from specdec.client.render import NEAREST_RANK, Cells, fields, markdown_table, spread
from specdec.drafters.registry import wants_draft
from specdec.types import SpecdecError

KINDS = ("coding-agent", "support-chat", "document-assistant")
RECORDS = "session-records.jsonl"
REPORT = "session-report"
BASELINE = "specdec:off"
WARMUP = ({"role": "user", "content": "Say hello."},)
PEER_SPEC = re.compile(r"^(plain|[a-z][a-z0-9-]*:k[1-9][0-9]*)$")
DEFAULT_PEER_SPECS = "plain,ngram-mod:k16"
CLIENT_KEEPALIVE_SECONDS = 2.0
DEFAULT_CACHE_RAM_MIB = 8192
PEER_CTX_FLOOR = 8192  # a session's context per llama-server slot: the longest shipped session fits

SESSION_LAYOUT = Layout(
    keys=("config", "level", "repeat", "session", "kind", "turn", "error", "text", "prompt_tokens", "cached_tokens",
          "tokens", "ttft", "decode_tokens_per_second", "seconds", "queued_seconds", "started_at", "finished_at"),
    measured={"error": "error", "text": "text", "prompt_tokens": "prompt_tokens", "tokens": "completion_tokens",
              "seconds": "wall_seconds", "ttft": "ttft_seconds", "decode_tokens_per_second": "decode_tokens_per_second",
              "started_at": "started_at", "finished_at": "finished_at"},
)


# -- the sessions ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Session:
    """One replayed conversation: its id (KIND-NNN), the shipped session it came from, its system
    prompt (with the session's own first line), optional tools and the fixed user turns."""

    id: str
    kind: str
    system: str
    turns: tuple[str, ...]
    tools: Optional[tuple[dict, ...]] = None


def validate(data: object, name: str) -> dict:
    """A shipped (or given) session file's content, checked: {"name", "description", "system",
    "tools"?, "turns": [{"role": "user", "content": str}, ...]}."""
    if not isinstance(data, dict):
        raise SpecdecError(f"session {name}: not a JSON object.")
    for key in ("name", "system"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise SpecdecError(f"session {name}: `{key}` must be a non-empty string.")
    turns = data.get("turns")
    if not isinstance(turns, list) or not turns:
        raise SpecdecError(f"session {name}: `turns` must be a non-empty list.")
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") != "user" or not isinstance(turn.get("content"), str) \
                or not turn["content"].strip():
            raise SpecdecError(f"session {name}: turn {index} must be {{\"role\": \"user\", \"content\": TEXT}}.")
    tools = data.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise SpecdecError(f"session {name}: `tools` must be a list of tool objects.")
    return data


def load_shipped() -> list[dict]:
    """The shipped sessions, in KINDS order, validated."""
    folder = resources.files("specdec") / "data" / "sessions"
    return [validate(json.loads((folder / f"{kind}.json").read_text(encoding="utf-8")), kind) for kind in KINDS]


def cycle_sessions(templates: Sequence[dict], count: int) -> list[Session]:
    """`count` sessions, cycling through `templates`; session i's system prompt starts with its
    own reference line, so no two sessions share a prefix beyond the chat template's first tokens.

    Example: 4 sessions of [a, b] -> a-001, b-002, a-003, b-004.
    """
    sessions = []
    for index in range(count):
        template = templates[index % len(templates)]
        ident = f"{template['name']}-{index + 1:03d}"
        tools = tuple(template["tools"]) if template.get("tools") else None
        sessions.append(Session(ident, template["name"], f"Conversation reference: {ident}.\n\n{template['system']}",
                                tuple(turn["content"] for turn in template["turns"]), tools))
    return sessions


# -- the replay ------------------------------------------------------------------------------------

def session_record(config: ServedConfig, session: Session, turn: int, measured: RequestRecord, queued: float) -> dict:
    """A session-records.jsonl line (run_sessions adds the level and the repeat)."""
    own = {key: value for key, value in measured.fields.items() if key != "chunk_gaps"}
    measured = replace(measured, fields=own)
    return measured.with_fields(config=config.label, session=session.id, kind=session.kind, turn=turn,
                                cached_tokens=(measured.stats or {}).get("cached_tokens"),
                                queued_seconds=queued).as_dict(SESSION_LAYOUT)


async def replay(client: httpx.AsyncClient, config: ServedConfig, session: Session, max_tokens: int,
                 slots: asyncio.Semaphore, key: str) -> list[dict]:
    """One session's turns in order, each reply appended to the conversation before the next turn;
    a failed turn ends the session (what follows it would not be the same conversation)."""
    messages: list[dict] = [{"role": "system", "content": session.system}]
    records = []
    for index, text in enumerate(session.turns):
        messages.append({"role": "user", "content": text})
        body = {"model": config.model, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": True,
                "prompt_cache_key": key, "user": key}
        if session.tools:
            body.update(tools=list(session.tools), tool_choice="none")  # the tools in the prompt, text replies
        if config.method is not None:
            body["speculative_decoding"] = {"method": config.method}
        waiting = time.perf_counter()
        async with slots:
            queued = time.perf_counter() - waiting
            started_at = time.time()
            measured = await _stream_once_retried(client, config.url, body)
            measured = replace(measured, started_at=started_at, finished_at=time.time())
        records.append(session_record(config, session, index, measured, queued))
        if measured.error is not None:
            break
        messages.append({"role": "assistant", "content": measured.text or ""})
    return records


async def _stream_once_retried(client: httpx.AsyncClient, url: str, body: dict) -> RequestRecord:
    """The turn's stream; sent again once where the server closed a kept-alive connection as the
    request went out on it (nothing processed: llama-server's cpp-httplib closes idle ones after
    5 s, httpx's default expiry), as the `openai` client retries; any other failure is the turn's."""
    for attempt in (1, 2):
        try:
            return await _stream(client, url, body)
        except httpx.RemoteProtocolError as exc:
            if attempt == 2 or "without sending a response" not in str(exc):
                return RequestRecord(error=f"{type(exc).__name__}: {exc}")
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a stream line that is not JSON
            return RequestRecord(error=f"{type(exc).__name__}: {exc}")
    raise AssertionError("unreachable")


async def run_level(config: ServedConfig, sessions: Sequence[Session], level: int, slots: int, max_tokens: int,
                    repeat: int = 0) -> list[dict]:
    """All sessions against one server: `level` open at once, at most `slots` requests in flight."""
    open_sessions, in_flight = asyncio.Semaphore(level), asyncio.Semaphore(slots)
    # Idle connections dropped before a server drops them (uvicorn and cpp-httplib: 5 s).
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_SECONDS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def one(session: Session) -> list[dict]:
            async with open_sessions:
                return await replay(client, config, session, max_tokens, in_flight,
                                    f"specdec-bench-{session.id}-r{repeat}")

        results = await asyncio.gather(*(one(session) for session in sessions))
    return [record for records in results for record in records]


@dataclass(frozen=True)
class SessionServer:
    """One configuration: `start()` starts its server alone and yields its base URL (stopped on exit)."""

    label: str
    start: Callable[[], ContextManager[str]]
    method: Optional[str] = None  # specdec's speculative_decoding method; None for a peer


async def _warm_up(config: ServedConfig) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        body = {"model": config.model, "messages": list(WARMUP), "max_tokens": 8, "temperature": 0, "stream": True,
                "cache_prompt": False}
        if config.method is not None:
            body["speculative_decoding"] = {"method": config.method}
        await _stream(client, config.url, body)


def run_sessions(servers: Sequence[SessionServer], sessions: Sequence[Session], levels: Sequence[int], slots: int,
                 max_tokens: int, repeats: int, records_path: Path, progress=print) -> list[dict]:
    """Every session at every level on every configuration, each on a fresh server alone, the
    order of configurations alternating; records appended to `records_path` block by block."""
    records = []
    with open(records_path, "a", encoding="utf-8") as out:
        for repeat in range(repeats):
            for index, level in enumerate(levels):
                order = list(servers) if (repeat + index) % 2 == 0 else list(reversed(servers))
                for server in order:
                    try:
                        with server.start() as url:
                            config = ServedConfig(server.label, url, server.method, served_model(url))
                            asyncio.run(_warm_up(config))
                            block = asyncio.run(run_level(config, sessions, level, slots, max_tokens, repeat))
                    except SpecdecError as exc:  # it did not start: one failed first turn per session
                        failed = ServedConfig(server.label, "", server.method)
                        block = [session_record(failed, session, 0, RequestRecord(error=f"server did not start: {exc}"),
                                                0.0) for session in sessions]
                    for record in block:
                        record.update(level=level, repeat=repeat)
                        out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()
                    records += block
                    progress(f"sessions: {server.label}, {level} at once, repeat {repeat + 1}/{repeats} done")
    return records


# -- the report ------------------------------------------------------------------------------------

def _texts(records: Sequence[dict], label: str) -> dict[tuple[str, int], Optional[str]]:
    """(session, turn) -> text of `label`'s sessions replayed alone: level 1, repeat 0."""
    return {(r["session"], r["turn"]): r["text"] for r in records
            if r["config"] == label and r["level"] == 1 and r["repeat"] == 0 and r["error"] is None}


def session_totals(records: Sequence[dict]) -> list[float]:
    """Per (session, repeat) that completed every turn it sent: first turn's start to last turn's end."""
    by: dict[tuple, list[dict]] = {}
    for r in records:
        by.setdefault((r["session"], r["repeat"]), []).append(r)
    return [max(r["finished_at"] for r in turns) - min(r["started_at"] for r in turns)
            for turns in by.values() if all(r["error"] is None for r in turns)]


def _iqr(values: Sequence[float]) -> dict:
    return fields(spread(values, NEAREST_RANK), ("median", "p25", "p75"))


def summarize(records: Sequence[dict], labels: Sequence[str], levels: Sequence[int]) -> tuple[list[dict], list[dict]]:
    """Rows per (configuration, level), and every turn whose text differs from the same session
    replayed alone on specdec's off or on its own configuration."""
    off = _texts(records, BASELINE)
    rows: list[dict] = []
    mismatches: list[dict] = []
    for label in labels:
        alone = _texts(records, label)
        for level in levels:
            mine = [r for r in records if r["config"] == label and r["level"] == level]
            if not mine:
                continue
            ok = [r for r in mine if r["error"] is None]
            later = [r for r in ok if r["turn"] > 0]
            prompt = sum(r["prompt_tokens"] or 0 for r in later if r["cached_tokens"] is not None)
            cached = sum(r["cached_tokens"] for r in later if r["cached_tokens"] is not None)
            row: dict[str, Any] = {"config": label, "level": level, "turns": len(mine), "errors": len(mine) - len(ok),
                                   "sessions": len({(r["session"], r["repeat"]) for r in mine})}
            for name, values in (("turn_seconds", [r["seconds"] for r in ok]),
                                 ("ttft_first", [r["ttft"] for r in ok if r["turn"] == 0 and r["ttft"] is not None]),
                                 ("ttft_later", [r["ttft"] for r in later if r["ttft"] is not None]),
                                 ("decode_tokens_per_second", [r["decode_tokens_per_second"] for r in ok
                                                               if r["decode_tokens_per_second"]]),
                                 ("session_seconds", session_totals(mine))):
                row.update({f"{name}_{key}": value for key, value in _iqr(values).items()})
            row["cached_share_later"] = cached / prompt if prompt else None
            for column, reference, against in (("texts_as_off_alone", off, BASELINE),
                                               ("texts_as_alone", alone, label)):
                compared = [r for r in ok if (r["session"], r["turn"]) in reference]
                differ = [r for r in compared if r["text"] != reference[(r["session"], r["turn"])]]
                row[column] = f"{len(compared) - len(differ)}/{len(compared)}" if reference else None
                if column == "texts_as_alone" and label == BASELINE:
                    continue  # listed above, against off alone
                mismatches += [{"config": label, "level": level, "repeat": r["repeat"], "session": r["session"],
                                "turn": r["turn"], "against": against} for r in differ]
            rows.append(row)
    alone_ttft = {row["config"]: row["ttft_later_median"] for row in rows if row["level"] == 1}
    for row in rows:  # later turns' TTFT against the same configuration's with one session at a time
        alone_median = alone_ttft.get(row["config"])
        row["ttft_later_vs_alone"] = row["ttft_later_median"] / alone_median \
            if alone_median and row["ttft_later_median"] is not None else None
    return rows, mismatches


def format_report(rows: Sequence[dict], mismatches: Sequence[dict]) -> str:
    cells = Cells()

    def iqr(row: dict, name: str, spec: str = ".2f") -> str:
        if row[f"{name}_median"] is None:
            return cells.missing
        median, span = row[f"{name}_median"], cells.span(row[f"{name}_p25"], row[f"{name}_p75"], spec)
        return f"{cells.number(median, spec)} ({span})"

    header = ["config", "sessions at once", "turn s, median (IQR)", "TTFT turn 1 s", "TTFT later turns s", "vs 1 at once",
              "decode tok/s", "session total s", "later turns' prompt cached", "texts as off alone",
              "texts as itself alone", "errors"]
    lines = markdown_table(header, [
        [r["config"], r["level"], iqr(r, "turn_seconds"), iqr(r, "ttft_first", ".3f"), iqr(r, "ttft_later", ".3f"),
         cells.number(r["ttft_later_vs_alone"], ".2f", "×"),
         iqr(r, "decode_tokens_per_second", ".1f"), iqr(r, "session_seconds", ".1f"),
         cells.number(None if r["cached_share_later"] is None else r["cached_share_later"] * 100, ".0f", " %"),
         r["texts_as_off_alone"] or cells.missing, r["texts_as_alone"] or cells.missing, r["errors"]]
        for r in rows])
    if mismatches:
        lines += ["", f"{len(mismatches)} turns differ from the same session replayed alone:", ""]
        lines += markdown_table(["config", "sessions at once", "repeat", "session", "turn", "differs from"],
                                [[m["config"], m["level"], m["repeat"], m["session"], m["turn"], m["against"]]
                                 for m in mismatches])
    return "\n".join(lines)


def write_report(records: Sequence[dict], labels: Sequence[str], levels: Sequence[int], out: Path) -> str:
    rows, mismatches = summarize(records, labels, levels)
    (out / f"{REPORT}.json").write_text(json.dumps({"rows": rows, "mismatches": mismatches}, indent=2) + "\n",
                                        encoding="utf-8")
    table = format_report(rows, mismatches)
    (out / f"{REPORT}.md").write_text(table + "\n", encoding="utf-8")
    return table


# -- the command -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("session benchmark (multi-turn sessions replayed through HTTP; "
                                      "bench/sessions.py)")
    group.add_argument("--sessions", type=int, default=None, metavar="N",
                       help="replay N sessions (cycled from the shipped coding-agent, support-chat and "
                            "document-assistant, each with its own prefix) against `specdec serve` per --methods "
                            "and llama-server (--peer llama-server=PATH); servers have max(--concurrency) slots")
    group.add_argument("--session-concurrency", default="1,4", metavar="LEVELS",
                       help="sessions open at once, per level (default 1,4; 1 always runs: the texts' reference)")
    group.add_argument("--session-peer-specs", default=DEFAULT_PEER_SPECS, metavar="SPECS",
                       help=f"llama-server configurations: plain, KIND:kK (--spec-type KIND --spec-draft-n-max K), "
                            f"draft:kK (default {DEFAULT_PEER_SPECS})")
    group.add_argument("--cache-ram", type=int, default=DEFAULT_CACHE_RAM_MIB, metavar="MIB",
                       help=f"MiB of prompt cache in host memory, llama-server's --cache-ram and specdec serve's "
                            f"(default {DEFAULT_CACHE_RAM_MIB})")


def _split(value: str) -> list[str]:
    return [item.strip() for item in str(value).split(",") if item.strip()]


@dataclass(frozen=True)
class SessionPlan:
    sessions: int
    levels: tuple[int, ...]
    slots: int
    methods: tuple[str, ...]
    peer_specs: tuple[str, ...]
    cache_ram_mib: int


def parse_flags(args: argparse.Namespace) -> SessionPlan:
    """The session flags checked; every error names the flag."""
    if args.sessions is None or args.sessions < 1:
        raise SpecdecError("--sessions must be at least 1.")
    try:
        levels = {int(level) for level in _split(args.session_concurrency)}
        slots = max(int(level) for level in _split(args.concurrency))
    except ValueError:
        raise SpecdecError("--session-concurrency and --concurrency take comma-separated integers, "
                           "e.g. 1,4.") from None
    if min(levels, default=0) < 1 or slots < 1:
        raise SpecdecError("--session-concurrency levels and --concurrency must be at least 1.")
    specs = _split(args.session_peer_specs)
    bad = [spec for spec in specs if not PEER_SPEC.match(spec)]
    if bad:
        raise SpecdecError(f"--session-peer-specs: {', '.join(bad)} is not plain or KIND:kK (e.g. ngram-mod:k16).")
    if args.cache_ram is None or args.cache_ram < 0:
        raise SpecdecError("--cache-ram takes MiB, 0 or more.")
    if args.max_tokens is None or args.max_tokens < 1 or args.repeats < 1:
        raise SpecdecError("--max-tokens and --repeats must be at least 1.")
    methods = [method.partition(":")[0] for method in _split(args.methods)]
    return SessionPlan(args.sessions, tuple(sorted(levels | {1})), slots,
                       tuple(dict.fromkeys(["off", *methods])), tuple(dict.fromkeys(specs)), args.cache_ram)


@contextmanager
def _started(server_class: Callable[..., Any], *arguments: Any) -> Iterator[str]:
    """A SpecdecServer or LlamaServer made and started (a free port each time), as its URL."""
    with server_class(*arguments) as server:
        yield server.url


def run_cli(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from specdec.bench.cli import META_FILE, _machine, _model_paths
    from specdec.bench.peers import LLAMA_SERVER, LlamaServer, parse_peers
    from specdec.bench.serving import SpecdecServer, llama_server_options

    plan = parse_flags(args)
    llama_server = parse_peers(args.peer).get(LLAMA_SERVER)
    need_draft = any(wants_draft(method) for method in plan.methods) or \
        (llama_server is not None and any(spec.startswith("draft:") for spec in plan.peer_specs))
    target, draft = _model_paths(args, need_draft=need_draft)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    serve_args = ["--cache-ram", str(plan.cache_ram_mib), *shlex.split(args.serve_args)]  # the same host memory as the peer
    servers = [SessionServer(f"specdec:{method}", partial(_started, SpecdecServer, plan.slots, serve_args,
                                                          out / f"specdec-serve-{method}.log"), method)
               for method in plan.methods]
    if llama_server:
        ctx = max(args.ctx_size or 0, PEER_CTX_FLOOR)
        for spec in plan.peer_specs:
            options = replace(llama_server_options(llama_server, target, draft, plan.slots, spec), ctx_size=ctx,
                              cache_ram_mib=plan.cache_ram_mib)
            log = out / f"llama-server-{spec.replace(':', '-')}.log"
            servers.append(SessionServer(f"llama-server:{spec}", partial(_started, LlamaServer, options, log)))
    sessions = cycle_sessions(load_shipped(), plan.sessions)
    records = run_sessions(servers, sessions, plan.levels, plan.slots, args.max_tokens, args.repeats, out / RECORDS,
                           progress=lambda line: print(line, file=sys.stderr))
    (out / META_FILE).write_text(json.dumps({
        "command": "specdec " + shlex.join(sys.argv[1:]), "machine": _machine(), "sessions": plan.sessions,
        "levels": list(plan.levels), "slots": plan.slots, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "cache_ram_mib": plan.cache_ram_mib, "configs": [s.label for s in servers]}, indent=2) + "\n",
        encoding="utf-8")
    print(write_report(records, [s.label for s in servers], plan.levels, out))
    print(f"specdec bench: session report in {out / (REPORT + '.md')}", file=sys.stderr)
    return 0
