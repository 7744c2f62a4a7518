"""`specdec bench --sessions` (bench/sessions.py): the shipped sessions, their cycling, the
replayed conversation, interleaving when more sessions are open than slots, records and report
from a run against servers on the fake backend, cached tokens read, and the flags' errors."""
import argparse
import asyncio
import json
from contextlib import contextmanager

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.bench import cli as bench_cli
from specdec.bench import sessions
from specdec.bench.peers import ServerOptions
from specdec.bench.serving import ServedConfig, llama_server_options
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecdecError

pytestmark = pytest.mark.timeout(300)

TEMPLATES = [
    {"name": "alpha", "system": "You answer briefly.", "turns": [
        {"role": "user", "content": "the cat sat on the mat"}, {"role": "user", "content": "and then?"},
        {"role": "user", "content": "why the mat"}]},
    {"name": "beta", "system": "You are a helpful assistant.", "turns": [
        {"role": "user", "content": "the dog ran"}, {"role": "user", "content": "where to"},
        {"role": "user", "content": "the end"}]},
]


# -- the shipped sessions -------------------------------------------------------------------------

def test_the_shipped_sessions_load_and_are_long_enough():
    shipped = {s["name"]: s for s in sessions.load_shipped()}
    assert list(shipped) == list(sessions.KINDS)
    coding = shipped["coding-agent"]
    source = coding["turns"][0]["content"]
    assert source.count("\n") >= 150 and "def parse_duration" in source
    assert any("FAILED tests/" in turn["content"] for turn in coding["turns"])
    support = shipped["support-chat"]
    assert len(support["system"]) >= 6000 and len(support["turns"]) >= 8  # ~1,500 tokens of policy
    assert all(len(turn["content"]) < 300 for turn in support["turns"])  # short turns
    document = shipped["document-assistant"]
    assert len(document["turns"][0]["content"]) >= 9000 and len(document["turns"]) >= 5  # ~2,500 tokens


@pytest.mark.parametrize("data, message", [
    ([], "not a JSON object"),
    ({"name": "x", "turns": [{"role": "user", "content": "hi"}]}, "`system`"),
    ({"name": "x", "system": "s", "turns": []}, "`turns`"),
    ({"name": "x", "system": "s", "turns": [{"role": "assistant", "content": "hi"}]}, "turn 0"),
    ({"name": "x", "system": "s", "turns": [{"role": "user", "content": " "}]}, "turn 0"),
    ({"name": "x", "system": "s", "turns": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, "`tools`"),
])
def test_a_malformed_session_is_refused(data, message):
    with pytest.raises(SpecdecError, match=message):
        sessions.validate(data, "x")


def test_sessions_cycle_with_a_prefix_of_their_own():
    cycled = sessions.cycle_sessions(TEMPLATES, 5)
    assert [s.id for s in cycled] == ["alpha-001", "beta-002", "alpha-003", "beta-004", "alpha-005"]
    assert [s.kind for s in cycled] == ["alpha", "beta", "alpha", "beta", "alpha"]
    assert len({s.system for s in cycled}) == 5  # prefixes differ across sessions
    assert cycled[0].system.startswith("Conversation reference: alpha-001.\n\n")
    assert cycled[0].system.endswith(TEMPLATES[0]["system"]) and cycled[2].system.endswith(TEMPLATES[0]["system"])
    assert cycled[0].turns == cycled[2].turns == ("the cat sat on the mat", "and then?", "why the mat")


# -- one session against a scripted server ---------------------------------------------------------

def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"


def _replay(handler, session, config=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await sessions.replay(client, config or ServedConfig("peer", "http://peer", None, "m"), session, 16,
                                         asyncio.Semaphore(1), "key-1")

    return asyncio.run(go())


def test_the_conversation_grows_with_the_replies_and_cached_tokens_are_read():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        turn = len(bodies)
        usage = {"prompt_tokens": 100 * turn, "completion_tokens": 2}
        final = {"choices": [], "usage": usage}
        if turn == 1:  # specdec's and OpenAI's usage
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
        elif turn == 2:  # llama-server's timings
            final["timings"] = {"cache_n": 90, "prompt_n": 110}
        return httpx.Response(200, content=_sse({"choices": [{"delta": {"content": f"reply {turn}"}}]},
                                                {"choices": [{"delta": {"content": "!"}}]}, final))

    session = sessions.cycle_sessions(TEMPLATES, 1)[0]
    records = _replay(handler, session)
    assert [r["turn"] for r in records] == [0, 1, 2]
    assert [r["text"] for r in records] == ["reply 1!", "reply 2!", "reply 3!"]
    assert [r["cached_tokens"] for r in records] == [0, 90, None]
    assert [r["prompt_tokens"] for r in records] == [100, 200, 300]
    assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
    last = bodies[-1]["messages"]
    assert last[0] == {"role": "system", "content": session.system}
    assert last[1:] == [{"role": "user", "content": "the cat sat on the mat"},
                        {"role": "assistant", "content": "reply 1!"}, {"role": "user", "content": "and then?"},
                        {"role": "assistant", "content": "reply 2!"}, {"role": "user", "content": "why the mat"}]
    for body in bodies:
        assert body["cache_prompt"] is True and body["prompt_cache_key"] == body["user"] == "key-1"
        assert body["temperature"] == 0 and body["max_tokens"] == 16 and "speculative_decoding" not in body
    assert all(r["error"] is None and r["queued_seconds"] >= 0 and r["finished_at"] >= r["started_at"]
               for r in records)
    assert "chunk_gaps" not in records[0]


def test_a_failed_turn_ends_the_session():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, content=b"busy")

    records = _replay(handler, sessions.cycle_sessions(TEMPLATES, 1)[0],
                      ServedConfig("specdec:auto", "http://s", "auto", "m"))
    assert len(records) == 1 and records[0]["error"].startswith("HTTP 503")

    def garbled(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: {not json\n\n")

    records = _replay(garbled, sessions.cycle_sessions(TEMPLATES, 1)[0])
    assert len(records) == 1 and records[0]["error"].startswith("JSONDecodeError")


def test_a_request_on_a_connection_the_server_had_just_closed_is_sent_again_once():
    """cpp-httplib closes an idle kept-alive connection as httpx reuses it: nothing was processed,
    so the turn goes again (as the `openai` client retries); twice in a row ends the session."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) in (2, 4, 5):
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, content=_sse({"choices": [{"delta": {"content": "ok"}}]},
                                                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}))

    records = _replay(handler, sessions.cycle_sessions(TEMPLATES, 1)[0])
    assert len(calls) == 5  # turn 1, turn 2 twice, turn 3 twice
    assert [r["error"] is None for r in records] == [True, True, False]
    assert records[2]["error"].startswith("RemoteProtocolError")


# -- a run against servers on the fake backend ----------------------------------------------------

def _fake_server(slots: int):
    @contextmanager
    def start():
        app = create_app(Engine(FakeBackend(seed=7, n_ctx=4096), n_slots=slots), ServerConfig(served_model_name="fake"))
        with serve_in_thread(app) as (url, _):
            yield url

    return start


def _sequential(records) -> bool:
    """Whether each session ended before the next one started."""
    by = {}
    for r in records:
        by.setdefault(r["session"], []).append(r)
    spans = sorted((min(r["started_at"] for r in rs), max(r["finished_at"] for r in rs)) for rs in by.values())
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_a_run_records_every_turn_and_reports_each_configuration_and_level(tmp_path):
    servers = [sessions.SessionServer("specdec:off", _fake_server(2), "off"),
               sessions.SessionServer("specdec:ngram", _fake_server(2), "ngram")]
    cycled = sessions.cycle_sessions(TEMPLATES, 4)
    lines = []
    records = sessions.run_sessions(servers, cycled, (1, 2, 4), 2, 12, 1, tmp_path / sessions.RECORDS,
                                    progress=lines.append)
    assert len(lines) == 2 * 3
    assert all(r["error"] is None for r in records)
    assert len(records) == 2 * 3 * 4 * 3  # configs x levels x sessions x turns
    assert len((tmp_path / sessions.RECORDS).read_text().splitlines()) == len(records)
    for r in records:
        assert r["ttft"] is not None and r["seconds"] >= r["ttft"] and r["prompt_tokens"] > 0
    # the conversation grows, and a later turn finds its session's start cached
    for label in ("specdec:off", "specdec:ngram"):
        one = [r for r in records if r["config"] == label and r["level"] == 1 and r["session"] == "alpha-001"]
        assert [r["turn"] for r in one] == [0, 1, 2]
        assert one[0]["prompt_tokens"] < one[1]["prompt_tokens"] < one[2]["prompt_tokens"]
        assert one[1]["cached_tokens"] > 0 and one[2]["cached_tokens"] > one[1]["cached_tokens"]

    def level(n, label="specdec:off"):
        return [r for r in records if r["config"] == label and r["level"] == n]

    assert _sequential(level(1))  # one session at a time
    two = level(2)
    third = min(r["started_at"] for r in two if r["session"] == "alpha-003")
    first_ended = min(max(r["finished_at"] for r in two if r["session"] == s) for s in ("alpha-001", "beta-002"))
    assert third >= first_ended  # the third session opens when one of the first two ends
    # four sessions open on two slots: their turns interleave, at most two requests in flight
    four = sorted(level(4), key=lambda r: r["started_at"])
    assert not _sequential(four)
    assert {r["session"] for r in four[:4]} != {"alpha-001"}
    for r in four:
        assert sum(o["started_at"] < r["started_at"] < o["finished_at"] for o in four) <= 1

    rows, mismatches = sessions.summarize(records, ["specdec:off", "specdec:ngram"], (1, 2, 4))
    by = {(row["config"], row["level"]): row for row in rows}
    assert set(by) == {(c, n) for c in ("specdec:off", "specdec:ngram") for n in (1, 2, 4)}
    for row in rows:  # greedy on the fake backend: every text is off's alone
        assert row["texts_as_off_alone"] == row["texts_as_alone"] == "12/12" and row["errors"] == 0
        assert row["turns"] == 12 and row["sessions"] == 4
        assert row["turn_seconds_p25"] <= row["turn_seconds_median"] <= row["turn_seconds_p75"]
        assert row["ttft_first_median"] is not None and row["ttft_later_median"] is not None
        assert row["session_seconds_median"] >= row["turn_seconds_median"]
    assert by[("specdec:off", 1)]["cached_share_later"] > 0.5
    assert by[("specdec:off", 1)]["ttft_later_vs_alone"] == 1.0
    assert by[("specdec:off", 4)]["ttft_later_vs_alone"] == pytest.approx(
        by[("specdec:off", 4)]["ttft_later_median"] / by[("specdec:off", 1)]["ttft_later_median"])
    assert mismatches == []
    table = sessions.write_report(records, ["specdec:off", "specdec:ngram"], (1, 2, 4), tmp_path)
    assert "| specdec:ngram | 4 |" in table and table.count("\n") == len(rows) + 1
    assert json.loads((tmp_path / "session-report.json").read_text())["rows"] == json.loads(json.dumps(rows))
    assert (tmp_path / "session-report.md").read_text() == table + "\n"


def test_the_shipped_sessions_replay_and_later_turns_find_their_start_cached(tmp_path):
    @contextmanager
    def start():
        app = create_app(Engine(FakeBackend(seed=7, n_ctx=16384), n_slots=2), ServerConfig(served_model_name="fake"))
        with serve_in_thread(app) as (url, _):
            yield url

    cycled = sessions.cycle_sessions(sessions.load_shipped(), 3)
    records = sessions.run_sessions([sessions.SessionServer("specdec:off", start, "off")], cycled, (1,), 2, 8, 1,
                                    tmp_path / sessions.RECORDS, progress=lambda line: None)
    assert len(records) == sum(len(s.turns) for s in cycled) and all(r["error"] is None for r in records)
    for previous, turn in zip(records, records[1:]):
        if turn["turn"] > 0:  # the whole previous prompt, and more, is cached
            assert turn["cached_tokens"] > previous["prompt_tokens"]
        else:  # another session: at most the chat template's start is shared
            assert turn["cached_tokens"] < 50


def _record(config, level, session, turn, text, repeat=0):
    return {"config": config, "level": level, "repeat": repeat, "session": session, "kind": "k", "turn": turn,
            "error": None, "text": text, "prompt_tokens": 10, "cached_tokens": 5, "tokens": 3, "ttft": 0.1,
            "decode_tokens_per_second": 30.0, "seconds": 0.2, "queued_seconds": 0.0, "started_at": 1.0 + turn,
            "finished_at": 1.2 + turn}


def test_texts_that_differ_from_the_session_alone_are_listed():
    records = [_record("specdec:off", 1, "s-001", 0, "a"), _record("specdec:off", 1, "s-001", 1, "b"),
               _record("specdec:off", 4, "s-001", 0, "a"), _record("specdec:off", 4, "s-001", 1, "B"),
               _record("llama-server:plain", 1, "s-001", 0, "a"), _record("llama-server:plain", 1, "s-001", 1, "c"),
               _record("llama-server:plain", 4, "s-001", 0, "a"), _record("llama-server:plain", 4, "s-001", 1, "c")]
    rows, mismatches = sessions.summarize(records, ["specdec:off", "llama-server:plain"], (1, 4))
    by = {(row["config"], row["level"]): row for row in rows}
    assert by[("specdec:off", 4)]["texts_as_off_alone"] == "1/2"
    assert by[("llama-server:plain", 4)]["texts_as_off_alone"] == "1/2"
    assert by[("llama-server:plain", 4)]["texts_as_alone"] == "2/2"
    assert by[("specdec:off", 1)]["session_seconds_median"] == pytest.approx(1.2)
    assert {(m["config"], m["level"], m["turn"], m["against"]) for m in mismatches} == {
        ("specdec:off", 4, 1, "specdec:off"), ("llama-server:plain", 1, 1, "specdec:off"),
        ("llama-server:plain", 4, 1, "specdec:off")}
    report = sessions.format_report(rows, mismatches)
    assert "3 turns differ from the same session replayed alone" in report


def test_without_off_alone_the_texts_are_not_compared():
    rows, _ = sessions.summarize([_record("llama-server:plain", 4, "s-001", 0, "a")], ["llama-server:plain"], (4,))
    assert rows[0]["texts_as_off_alone"] is None and rows[0]["texts_as_alone"] is None
    assert rows[0]["ttft_later_vs_alone"] is None
    assert "| llama-server:plain | 4 |" in sessions.format_report(rows, [])


# -- flags -----------------------------------------------------------------------------------------

def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flags_make_a_plan():
    plan = sessions.parse_flags(_args("--sessions", "12", "--session-concurrency", "4,12", "--concurrency", "4",
                                      "--methods", "auto,ngram:k3", "--session-peer-specs", "plain,ngram-mod:k16"))
    assert plan.sessions == 12 and plan.levels == (1, 4, 12) and plan.slots == 4  # 1 always: the reference
    assert plan.methods == ("off", "auto", "ngram") and plan.peer_specs == ("plain", "ngram-mod:k16")
    assert plan.cache_ram_mib == sessions.DEFAULT_CACHE_RAM_MIB
    assert _args().sessions is None  # no --sessions: the other modes


@pytest.mark.parametrize("argv, message", [
    (["--sessions", "0"], "--sessions"),
    (["--sessions", "3", "--session-concurrency", "1,x"], "comma-separated integers"),
    (["--sessions", "3", "--session-concurrency", "0"], "at least 1"),
    (["--sessions", "3", "--concurrency", "0"], "at least 1"),
    (["--sessions", "3", "--session-peer-specs", "plain,ngram-mod:16"], "ngram-mod:16"),
    (["--sessions", "3", "--session-peer-specs", "draft:k0"], "draft:k0"),
    (["--sessions", "3", "--cache-ram", "-1"], "--cache-ram"),
    (["--sessions", "3", "--max-tokens", "0"], "--max-tokens"),
])
def test_bad_flags_are_refused(argv, message):
    with pytest.raises(SpecdecError, match=message):
        sessions.parse_flags(_args(*argv))


def test_llama_server_gets_its_prompt_cache_in_memory_and_its_speculation():
    options = llama_server_options("bin", "t.gguf", None, 4, "ngram-mod:k16")
    command = ServerOptions(**{**options.__dict__, "cache_ram_mib": 8192}).command(8080)
    assert command[command.index("--cache-ram") + 1] == "8192"
    assert command[command.index("--spec-type") + 1] == "ngram-mod"
    assert command[command.index("--spec-draft-n-max") + 1] == "16" and command[command.index("-np") + 1] == "4"
    assert "--cache-ram" not in ServerOptions("bin", "t.gguf").command(8080)


def test_a_server_that_does_not_start_gives_each_session_a_failed_record(tmp_path):
    @contextmanager
    def broken():
        raise SpecdecError("llama-server exited with code 1 while starting")
        yield "unreachable"

    servers = [sessions.SessionServer("llama-server:plain", broken)]
    records = sessions.run_sessions(servers, sessions.cycle_sessions(TEMPLATES, 2), (1,), 2, 8, 1,
                                    tmp_path / sessions.RECORDS, progress=lambda line: None)
    assert [(r["session"], r["turn"], r["level"]) for r in records] == [("alpha-001", 0, 1), ("beta-002", 0, 1)]
    assert all(r["error"].startswith("server did not start: llama-server exited") for r in records)
    rows, _ = sessions.summarize(records, ["llama-server:plain"], (1,))
    assert rows[0]["errors"] == 2 and rows[0]["session_seconds_median"] is None


FAKE_LLAMA_SERVER = '''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
LOG = %r
with open(LOG, "a") as log:
    log.write(json.dumps(argv) + "\\n")
seen = {}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body, kind="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(json.dumps({"status": "ok"} if self.path == "/health" else {"data": [{"id": "llama"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = sum(len(m["content"]) for m in body["messages"])
        cached = seen.get(body.get("prompt_cache_key"), 0)
        seen[body.get("prompt_cache_key")] = prompt
        chunks = [{"choices": [{"delta": {"content": word}}]} for word in ("ok ", body["messages"][-1]["content"][:8])]
        chunks.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 2},
                       "timings": {"cache_n": cached}})
        self._send(b"".join(b"data: " + json.dumps(c).encode() + b"\\n\\n" for c in chunks) + b"data: [DONE]\\n\\n",
                   "text/event-stream")


HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
'''


def test_the_command_runs_specdec_and_llama_server_each_alone_and_writes_the_report(tmp_path, monkeypatch, capsys):
    import stat
    import sys

    from specdec.bench import serving

    log = tmp_path / "argv.jsonl"
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + FAKE_LLAMA_SERVER % str(log))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    started = []

    class FakeSpecdec:
        def __init__(self, slots, extra_args, log_path):
            started.append((slots, list(extra_args), log_path.name))
            app = create_app(Engine(FakeBackend(seed=7, n_ctx=4096), n_slots=slots), ServerConfig(served_model_name="f"))
            self._serving = serve_in_thread(app)

        def __enter__(self):
            self.url, _ = self._serving.__enter__()
            return self

        def __exit__(self, *exc):
            self._serving.__exit__(*exc)

    monkeypatch.setattr(serving, "SpecdecServer", FakeSpecdec)
    monkeypatch.setattr(bench_cli, "_model_paths", lambda args, need_draft: ("t.gguf", None))
    monkeypatch.setattr(sessions, "load_shipped", lambda: TEMPLATES)
    out = tmp_path / "out"
    args = _args("--sessions", "3", "--session-concurrency", "3", "--concurrency", "2", "--methods", "off,ngram",
                 "--peer", f"llama-server={binary}", "--session-peer-specs", "plain,ngram-mod:k16", "--cache-ram",
                 "1024", "--max-tokens", "8", "--serve-args", "--ctx-size 4096", "--out", str(out))
    assert bench_cli.run(args) == 0
    # The same host memory for prompts as llama-server's --cache-ram
    off, ngram = ((2, ["--cache-ram", "1024", "--ctx-size", "4096"], f"specdec-serve-{method}.log")
                  for method in ("off", "ngram"))
    assert started == [off, ngram, ngram, off]  # a fresh server per level (1, 3), the order alternating
    commands = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(commands) == 4  # two configurations x two levels, each started alone
    for command in commands:
        assert command[command.index("--cache-ram") + 1] == "1024" and command[command.index("-np") + 1] == "2"
        assert command[command.index("-c") + 1] == str(2 * sessions.PEER_CTX_FLOOR)
    assert sum("--spec-type" in command for command in commands) == 2
    records = [json.loads(line) for line in (out / sessions.RECORDS).read_text().splitlines()]
    assert len(records) == 4 * 2 * 3 * 3 and all(r["error"] is None for r in records)
    llama = [r for r in records if r["config"] == "llama-server:plain" and r["level"] == 1]
    beta = [r for r in llama if r["session"] == "beta-002"]  # the stand-in reports the previous turn's prompt cached
    assert [r["cached_tokens"] for r in beta] == [0, beta[0]["prompt_tokens"], beta[1]["prompt_tokens"]]
    report = json.loads((out / "session-report.json").read_text())
    assert [(row["config"], row["level"]) for row in report["rows"]] == [
        (c, n) for c in ("specdec:off", "specdec:ngram", "llama-server:plain", "llama-server:ngram-mod:k16")
        for n in (1, 3)]
    assert {m["config"] for m in report["mismatches"]} == {"llama-server:plain", "llama-server:ngram-mod:k16"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["levels"] == [1, 3] and meta["slots"] == 2 and meta["cache_ram_mib"] == 1024
    assert "| llama-server:ngram-mod:k16 | 3 |" in capsys.readouterr().out
