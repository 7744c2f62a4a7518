"""A running server moves onto a better build (server/upgrade.py): loaded beside the serving
engine, its costs measured by the worker between rounds, then new requests go to it while those
running finish on the old engine, even on a server that is never idle; requests before, during and
after the switch are all answered, each exactly, and the old engine is closed only once no request
can still use it."""
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from fakes.threads import in_thread, wait_until

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app, upgrade
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SpecConfig

pytestmark = pytest.mark.timeout(60)


class ClosingFake(FakeBackend):
    def __init__(self, delay=0.002, forwards=None, **kw):
        super().__init__(**kw)
        self.delay = delay
        self.closed = False
        self.threads = set()
        self.forwards = forwards if forwards is not None else []  # (backend, ...) in the order run, shared

    def eval(self, seq_id, start, tokens, *, prefill=False):
        assert not self.closed, "a closed engine was used"
        self.threads.add(threading.current_thread().name)
        self.forwards.append(self)
        time.sleep(self.delay * (1 + 0.2 * len(tokens)))  # longer forwards cost more, as a calibration expects
        return super().eval(seq_id, start, tokens, prefill=prefill)

    def close(self):
        self.closed = True


def body(max_tokens=40):
    return {"model": "fake", "prompt": "the cat", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def expected_text(max_tokens=40):
    engine = Engine(FakeBackend(seed=7))
    ids = engine.encode_prompt("the cat", chat=False)
    return engine.generate(GenerationRequest(tuple(ids), max_tokens, spec=SpecConfig("off", 0))).text


def streamed_text(url, request):
    """The text of a streamed completion, read to its end."""
    text = []
    with httpx.Client(timeout=30) as client, client.stream("POST", url + "/v1/completions",
                                                           json={**request, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
    return "".join(text)


def test_the_new_build_is_loaded_beside_the_serving_engine_measured_between_rounds_and_swapped_under_load():
    forwards = []
    old_backend, new_backend = ClosingFake(delay=0.005, seed=7, forwards=forwards), ClosingFake(seed=7, forwards=forwards)
    app = create_app(Engine(old_backend, n_slots=2), ServerConfig(served_model_name="fake", spec=SpecConfig("ngram", 3)))
    scheduler = app.state.specdec.scheduler
    running_at_switch, forwards_at_switch = [], []
    scheduler.engine_listeners.append(lambda engine: (running_at_switch.append(scheduler.num_running),
                                                      forwards_at_switch.append(list(forwards))))
    loading, release = threading.Event(), threading.Event()
    loaded_on = []

    def prepare(engine, library):
        loaded_on.append(threading.current_thread().name)
        loading.set()
        release.wait(30)  # loading takes a while: the old engine serves meanwhile
        return Engine(new_backend, n_slots=2)

    watcher = upgrade.BuildWatcher(scheduler.engine, scheduler.request_switch, poll=0.01, prepare=prepare,
                                   finished=lambda: Path("/the/build/libllama.so"))
    with serve_in_thread(app) as (url, _):
        watcher.start()
        assert loading.wait(10)
        during = httpx.post(url + "/v1/completions", json=body(), timeout=30)  # answered while the build loads
        assert during.status_code == 200 and during.json()["choices"][0]["text"] == expected_text()
        assert scheduler.engine.target is old_backend and loaded_on == ["specdec-build-watcher"]
        # A long stream keeps the server busy throughout: the switch does not wait for it.
        stream, result = in_thread(streamed_text, url, body(1000))
        wait_until(lambda: scheduler.num_running == 1 and len(old_backend.eval_calls) > 20)
        release.set()
        wait_until(lambda: scheduler.engine.target is new_backend)
        assert app.state.specdec.engine.target is new_backend and running_at_switch == [1] and stream.is_alive()
        old_forwards = len(old_backend.eval_calls)
        after = httpx.post(url + "/v1/completions", json=body(), timeout=30)  # a new request: the new build's
        assert after.json()["choices"][0]["text"] == expected_text() and new_backend.eval_calls
        assert len(old_backend.eval_calls) > old_forwards and not old_backend.closed  # the stream goes on there
        stream.join(30)
        assert result["value"] == expected_text(1000)
        wait_until(lambda: old_backend.closed, timeout=5)  # its last request is over
        assert not new_backend.closed
        # The new build's costs were measured by the worker, between the old engine's rounds, and
        # adopted (or rejected as implausible where this machine's load jolts the fake's sleeps).
        assert new_backend.threads == {"specdec-scheduler"}
        before = forwards_at_switch[0]
        measuring = before[before.index(new_backend):]
        assert measuring.count(new_backend) > 120  # 4 x 15 timed pairs and the scratch prompt
        assert measuring.count(old_backend) > 20  # the stream's rounds went on between them
        assert scheduler.costs.new_build is False or scheduler.costs.due_at is not None  # adopted, or to measure again
    watcher.stop()


def test_the_old_engine_stays_open_while_a_request_begun_before_the_switch_is_in_flight():
    old_backend, new_backend = ClosingFake(seed=7), ClosingFake(seed=7)
    app = create_app(Engine(old_backend), ServerConfig(served_model_name="fake", spec=SpecConfig("off", 0)))
    scheduler = app.state.specdec.scheduler
    with serve_in_thread(app) as (url, _):
        tokenizing = scheduler.users.enter()  # a request that read the old engine and is still tokenizing
        scheduler.request_switch(Engine(new_backend))
        wait_until(lambda: scheduler.engine.target is new_backend)
        assert httpx.post(url + "/v1/completions", json=body(), timeout=30).status_code == 200
        time.sleep(0.2)
        assert not old_backend.closed
        scheduler.users.leave(tokenizing)
        wait_until(lambda: old_backend.closed, timeout=5)


def test_a_build_that_does_not_load_leaves_the_server_serving_on_the_old_engine():
    backend = ClosingFake(seed=7)
    app = create_app(Engine(backend), ServerConfig(served_model_name="fake", spec=SpecConfig("off", 0)))
    scheduler = app.state.specdec.scheduler
    attempts = []

    def prepare(engine, library):
        attempts.append(library)
        raise RuntimeError("the new build does not load")

    watcher = upgrade.BuildWatcher(scheduler.engine, scheduler.request_switch, poll=0.01, prepare=prepare,
                                   finished=lambda: Path("/the/build/libllama.so"))
    with serve_in_thread(app) as (url, _):
        watcher.start()
        wait_until(lambda: attempts and not watcher._thread.is_alive())
        response = httpx.post(url + "/v1/completions", json=body(), timeout=30)
        assert response.status_code == 200 and scheduler.engine.target is backend and not backend.closed
        assert scheduler._switch is None


def test_a_build_counts_as_finished_only_when_complete_and_runnable(tmp_path, monkeypatch):
    from specdec.backends.bindings import ik_llama

    folder = tmp_path / "ik-build"
    pending = tmp_path / "ik-pending"
    pending.write_text(str(folder) + "\n")
    library = folder / "unpacked" / "ik_llama_cpp" / "lib" / "libllama.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    monkeypatch.setattr(ik_llama, "cpu_runs", lambda path=None: True)
    assert upgrade.finished_build(pending) is None  # no wheel yet: the build is still running
    (folder / "ik_llama_cpp_python-0.1.5-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    assert upgrade.finished_build(pending) == library
    monkeypatch.setattr(ik_llama, "cpu_runs", lambda path=None: False)
    assert upgrade.finished_build(pending) is None  # built for instructions this CPU lacks
    assert upgrade.finished_build(tmp_path / "absent") is None


def test_only_an_ik_engine_on_pypis_wheel_is_provisional():
    assert not upgrade.provisional(Engine(FakeBackend(seed=7)))  # no model configuration: not runtime's


def test_the_builds_progress_is_read_from_its_log(tmp_path):
    folder = tmp_path / "ik-build"
    folder.mkdir()
    pending = tmp_path / "ik-pending"
    pending.write_text(str(folder) + "\n")
    assert upgrade.build_progress(pending) is None  # no log yet
    (folder / "build.log").write_text("specdec: building\n")
    assert upgrade.build_progress(pending) is None  # cmake has not started compiling
    (folder / "build.log").write_text("  [9/43] Building CXX object a.o\n  [10/43] Building CXX object b.o\n")
    assert upgrade.build_progress(pending) == (10, 43)
