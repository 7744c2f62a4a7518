"""Grammars compiled once per distinct spec (a bounded LRU cache), on the grammar threads (never the
event loop's nor the engine worker's), within a time limit whose breach is a 400 naming the field
while other requests are answered; the choices of one request copy one compiled matcher."""
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.grammar import compiler as compiler_module
from specdec.grammar.compiler import GrammarBusy, GrammarCompiler, GrammarTimeout, _Runner
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GrammarSpec, SpecConfig, SpecdecError

pytestmark = pytest.mark.timeout(120)

MODEL = "fake-target"


def schema(tag=None):
    """A small schema made distinct by its title (so each test compiles it afresh)."""
    return {"title": tag or uuid.uuid4().hex, "type": "object", "properties": {"name": {"type": "string",
            "maxLength": 8}}, "required": ["name"], "additionalProperties": False}


def spec(tag=None):
    return GrammarSpec("json_schema", json.dumps(schema(tag)))


@pytest.fixture(scope="module")
def server():
    engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=4)
    app = create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4)))
    with serve_in_thread(app) as (url, _):
        yield url, engine


@pytest.fixture
def builds(monkeypatch):
    """Every compilation of a grammar for the vocabulary: (spec source, thread name)."""
    seen = []
    real = GrammarCompiler._matcher

    def spy(self, kind, source):
        seen.append((source, threading.current_thread().name))
        if "slow-" in source:
            time.sleep(1.5)
        return real(self, kind, source)

    monkeypatch.setattr(GrammarCompiler, "_matcher", spy)
    return seen


@pytest.fixture
def copies(monkeypatch):
    """Every constraint made for a generation: the thread that made it."""
    seen = []
    real = GrammarCompiler.constraint

    def spy(self, grammar):
        seen.append(threading.current_thread().name)
        return real(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "constraint", spy)
    return seen


def chat(url, response_format=None, n=1, timeout=60, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the cat sat on the mat"}], "temperature": 0.7,
            "max_tokens": 24, "n": n, **kw}
    if response_format is not None:
        body["response_format"] = response_format
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def json_format(value):
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": value}}


def test_a_schema_is_compiled_once_for_n_choices_and_for_repeated_requests(server, builds, copies):
    url, _ = server
    value = schema()
    for _ in range(3):
        answer = chat(url, json_format(value), n=4)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"]) == 4
    source = json.dumps(value)
    assert [each for each, _ in builds].count(source) == 1  # 12 choices, one compilation
    assert len(copies) == 12  # each choice its own copy of the matcher


def test_compilation_runs_on_neither_the_event_loop_nor_the_engine_worker(server, builds, copies):
    url, _ = server
    answer = chat(url, json_format(schema()), n=2)
    assert answer.status_code == 200, answer.text
    tools = [{"type": "function", "function": {"name": "get", "parameters": schema()}}]
    answer = chat(url, tools=tools, tool_choice="required")
    assert answer.status_code == 200, answer.text
    assert len(builds) == 2
    assert all(name.startswith("specdec-grammar") for _, name in builds), builds
    assert copies and set(copies) == {"specdec-scheduler"}  # the engine worker only copies


@pytest.mark.parametrize("field", ["response_format", "tools"])
def test_a_grammar_past_the_time_limit_is_a_400_naming_the_field_while_others_are_answered(server, builds,
                                                                                          monkeypatch, field):
    url, engine = server
    monkeypatch.setattr(engine.grammars, "time_limit", 0.8)
    slow = schema(f"slow-{uuid.uuid4().hex}")
    kw = ({"response_format": json_format(slow)} if field == "response_format" else
          {"tools": [{"type": "function", "function": {"name": "get", "parameters": slow}}], "tool_choice": "required"})
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        pending = pool.submit(chat, url, **kw)
        time.sleep(0.1)
        for other in (None, json_format(schema())):  # plain, and another grammar compiled meanwhile
            answer = chat(url, other)
            assert answer.status_code == 200, answer.text
        assert not pending.done()
        refused = pending.result()
        assert time.monotonic() - started >= 0.8
        slow_source = next(each for each, _ in builds if "slow-" in each)
        kind = "lark" if field == "tools" else "json_schema"
        assert (kind, slow_source) not in engine.grammars._cache  # refused at the limit, the compile still running
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    param = "response_format.json_schema.schema" if field == "response_format" else "tools"
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and "0.8 s to compile" in error["message"]
    time.sleep(0.8)  # the abandoned compilation ends; its result is kept for the next one
    assert chat(url, **kw).status_code == 200
    assert [each for each, _ in builds].count(slow_source) == 1


def test_too_many_grammars_waiting_is_busy_not_a_pile():
    runner = _Runner(workers=1, max_queued=1)
    release = threading.Event()
    first = threading.Thread(target=runner.run, args=("a", release.wait, None, "grammar"))
    first.start()
    time.sleep(0.1)
    waiting = threading.Thread(target=runner.run, args=("b", lambda: None, None, "grammar"))
    waiting.start()
    time.sleep(0.1)
    with pytest.raises(GrammarBusy):
        runner.run("c", lambda: None, 5.0, "grammar")
    release.set()
    first.join(5)
    waiting.join(5)


def test_the_cache_is_bounded_and_least_recently_used_goes_first(builds):
    compiler = GrammarCompiler(FakeBackend(seed=7), cache_size=2)
    a, b, c = spec("a"), spec("b"), spec("c")
    for each in (a, b, a, c):  # a used again before c comes: b is the one dropped
        compiler.compile(each)
    assert len(builds) == 3
    compiler.compile(a)
    compiler.compile(c)
    assert len(builds) == 3
    compiler.compile(b)
    assert [source for source, _ in builds] == [a.source, b.source, c.source, b.source]
    assert len(compiler._cache) == 2


def test_the_same_grammar_asked_at_once_is_compiled_once(builds):
    compiler = GrammarCompiler(FakeBackend(seed=7))
    grammar = spec("slow-once")
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(lambda _: compiler.compile(grammar), range(4)))
    assert len(builds) == 1 and all(each is compiled[0] for each in compiled)


def test_a_refusal_is_cached_and_the_limit_raises_grammar_timeout(builds):
    compiler = GrammarCompiler(FakeBackend(seed=7), time_limit=0.3)
    bad = GrammarSpec("lark", "start: undefined_rule\n")
    for _ in range(2):
        with pytest.raises(SpecdecError, match="cannot be used"):
            compiler.compile(bad)
    assert len(builds) == 1
    with pytest.raises(GrammarTimeout, match="took longer than 0.3 s"):
        compiler.compile(spec("slow-limit"))


def test_the_engine_alone_compiles_on_demand_and_copies_per_generation(builds):
    engine = Engine(FakeBackend(seed=7), n_slots=1)
    grammar = spec()
    first, second = engine.grammars.constraint(grammar), engine.grammars.constraint(grammar)
    assert first is not second and len(builds) == 1
    forced = first.forced_after(())
    assert forced
    first.commit(forced)  # one copy moving on leaves the other at the start
    assert second.forced_after(()) == forced and first.forced_after(()) != forced


def test_a_tool_schema_past_the_limit_is_a_400_naming_the_tool(server, monkeypatch):
    url, engine = server
    monkeypatch.setattr(engine.grammars, "time_limit", 0.5)
    real = compiler_module._error

    def slow(grammar):
        if "slow-" in grammar.source:
            time.sleep(1.0)
        return real(grammar)

    monkeypatch.setattr(compiler_module, "_error", slow)
    tools = [{"type": "function", "function": {"name": "fast", "parameters": schema()}},
             {"type": "function", "function": {"name": "slow", "parameters": schema(f"slow-{uuid.uuid4().hex}")}}]
    refused = chat(url, tools=tools)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "tools[1].function.parameters"
    assert "0.5 s to compile" in refused.json()["error"]["message"]
    time.sleep(0.6)
