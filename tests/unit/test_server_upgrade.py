"""A running server moves onto a better build at an idle moment (server/upgrade.py): requests
before, during and after the switch are all answered, each exactly, and the old engine is
closed only once nothing can still use it."""
import time

import httpx
import pytest

from fakes.threads import in_thread, wait_until

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app, scheduler as scheduler_module, upgrade
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SpecConfig

pytestmark = pytest.mark.timeout(60)


class ClosingFake(FakeBackend):
    def __init__(self, delay=0.002, **kw):
        super().__init__(**kw)
        self.delay = delay
        self.closed = False

    def eval(self, seq_id, start, tokens, *, prefill=False):
        assert not self.closed, "a closed engine was used"
        time.sleep(self.delay)
        return super().eval(seq_id, start, tokens, prefill=prefill)

    def close(self):
        self.closed = True


def body(max_tokens=40):
    return {"model": "fake", "prompt": "the cat", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def expected_text(max_tokens=40):
    engine = Engine(FakeBackend(seed=7))
    ids = engine.encode_prompt("the cat", chat=False)
    return engine.generate(GenerationRequest(tuple(ids), max_tokens, spec=SpecConfig("off", 0))).text


def test_the_server_switches_engines_when_idle_and_closes_the_old_one_later(monkeypatch):
    monkeypatch.setattr(scheduler_module, "RETIRED_ENGINE_SECONDS", 0.3)
    old_backend, new_backend = ClosingFake(seed=7), ClosingFake(seed=7)
    app = create_app(Engine(old_backend), ServerConfig(served_model_name="fake", spec=SpecConfig("ngram", 3)))
    scheduler = app.state.specdec.scheduler
    built = []

    def factory():
        built.append(time.monotonic())
        time.sleep(0.2)  # loading and calibrating take a while: requests arriving meanwhile wait
        return Engine(new_backend)

    with serve_in_thread(app) as (url, _):
        running, result = in_thread(httpx.post, url + "/v1/completions", json=body(300), timeout=30)
        wait_until(lambda: scheduler.num_running == 1)
        scheduler.request_switch(factory)
        time.sleep(0.1)
        assert not built  # not while a request runs
        running.join(30)
        assert result["value"].status_code == 200
        wait_until(lambda: built)
        during = httpx.post(url + "/v1/completions", json=body(), timeout=30)  # queued behind the switch
        assert during.status_code == 200 and during.json()["choices"][0]["text"] == expected_text()
        assert app.state.specdec.engine.target is new_backend and scheduler.engine.target is new_backend
        new_backend.eval_calls.clear()
        after = httpx.post(url + "/v1/completions", json=body(), timeout=30)
        assert after.json()["choices"][0]["text"] == expected_text() and new_backend.eval_calls
        wait_until(lambda: old_backend.closed, timeout=5)
        assert not new_backend.closed


def test_a_failed_switch_keeps_serving_on_the_old_engine():
    backend = ClosingFake(seed=7)
    app = create_app(Engine(backend), ServerConfig(served_model_name="fake", spec=SpecConfig("off", 0)))
    scheduler = app.state.specdec.scheduler

    def factory():
        raise RuntimeError("the new build does not load")

    with serve_in_thread(app) as (url, _):
        scheduler.request_switch(factory)
        wait_until(lambda: scheduler._switch is None)
        response = httpx.post(url + "/v1/completions", json=body(), timeout=30)
        assert response.status_code == 200 and scheduler.engine.target is backend and not backend.closed


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
