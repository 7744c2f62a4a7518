"""Faults after a request was accepted: a backend call that never returns (the watchdog), the
worker thread dying, a backend failing mid-stream. Every request in flight gets an answer — the
documented error event inside a started stream, an OpenAI-shaped 5xx otherwise — and /health says
what is wrong; time limits keep working while the worker is stuck; the server recovers."""
import json
import threading

import httpx
import openai
import pytest
from fakes.threads import in_thread, wait_until
from fakes.timed_backend import HangingBackend

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "fake"
CLIENT_TIMEOUT = 20  # a hang in the server fails the test instead of hanging it


def make_app(backend, n_slots=1, **config):
    config.setdefault("spec", SpecConfig("off", 0))
    return create_app(Engine(backend, n_slots=n_slots), ServerConfig(served_model_name=MODEL, **config))


def body(prompt="the cat", max_tokens=2000, stream=False):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def reference(prompt, max_tokens):
    engine = Engine(FakeBackend(seed=7))
    ids = engine.encode_prompt(prompt, chat=False)
    return engine.generate(GenerationRequest(tuple(ids), max_tokens, SamplingParams(), SpecConfig("off", 0)))




class Stream:
    """A streaming request read in a thread: its SSE data lines as they arrive."""

    def __init__(self, url, request):
        self.lines = []
        self.error = None
        self.thread = threading.Thread(target=self._read, args=(url, request), daemon=True)
        self.thread.start()

    def _read(self, url, request):
        try:
            with httpx.stream("POST", url + "/v1/completions", json=request, timeout=CLIENT_TIMEOUT) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[len("data: "):])
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def join(self):
        self.thread.join(CLIENT_TIMEOUT + 5)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.lines

    def text(self):
        return "".join(json.loads(line)["choices"][0]["text"] for line in self.lines
                       if line.startswith("{") and "choices" in json.loads(line))




def assert_error_event(lines, code):
    """A started stream that failed: chunks, then ONE error event, then [DONE]; no finish_reason."""
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    event = json.loads(lines[-2])
    assert set(event) == {"error"} and set(event["error"]) == {"message", "type", "param", "code"}
    assert event["error"]["code"] == code and event["error"]["type"] == "server_error" and event["error"]["message"]
    chunks = [json.loads(line) for line in lines[:-2]]
    assert chunks and all("choices" in chunk for chunk in chunks)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    return event["error"]


def assert_openai_error(response, status, code):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def metric(url, name):
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith(name))


def test_a_stalled_backend_makes_the_server_unhealthy_fails_what_is_in_flight_and_recovers():
    backend = HangingBackend(row_seconds=0.002, seed=7)
    app = make_app(backend, stall_timeout=1.0)
    with serve_in_thread(app) as (url, _):
        scheduler = app.state.specdec.scheduler
        stream = Stream(url, body(stream=True))
        wait_until(lambda: len(stream.lines) >= 5)
        backend.hang()
        assert backend.stuck.wait(5)
        queued, queued_result = in_thread(httpx.post, url + "/v1/completions", json=body(max_tokens=5),
                                          timeout=CLIENT_TIMEOUT)
        wait_until(lambda: scheduler.num_waiting == 1)

        lines = stream.join()  # the watchdog ends it, with the backend still stuck
        error = assert_error_event(lines, "backend_stalled")
        assert "not returned" in error["message"]
        assert reference("the cat", 2000).text.startswith(stream.text())
        queued.join(CLIENT_TIMEOUT)
        assert_openai_error(queued_result["value"], 503, "backend_stalled")
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "has not returned" in health.json()["reason"]
        assert_openai_error(httpx.post(url + "/v1/completions", json=body(max_tokens=5)), 503, "backend_stalled")
        assert metric(url, "specdec:backend_stalls_total") == 1
        assert backend.stuck.is_set()  # all of the above happened while the call was still stuck

        backend.release()
        wait_until(lambda: httpx.get(url + "/health").status_code == 200)
        again = httpx.post(url + "/v1/completions", json=body(max_tokens=30), timeout=CLIENT_TIMEOUT)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference("the cat", 30).text
        wait_until(lambda: scheduler.num_running == 0)  # the worker releases the slot just after the last event


def test_time_limits_and_queue_timeouts_hold_while_the_worker_is_stuck():
    backend = HangingBackend(row_seconds=0.002, seed=7)
    app = make_app(backend, request_timeout=1.0, stall_timeout=60.0, retry_after=2)
    with serve_in_thread(app) as (url, _):
        scheduler = app.state.specdec.scheduler
        stream = Stream(url, body(stream=True))
        wait_until(lambda: len(stream.lines) >= 3)
        backend.hang()
        assert backend.stuck.wait(5)
        queued = httpx.post(url + "/v1/completions", json=body(max_tokens=5), timeout=CLIENT_TIMEOUT)
        assert_openai_error(queued, 503, "timeout")  # it waited past its limit for the stuck slot
        assert queued.headers["retry-after"] == "2"

        lines = stream.join()  # cut at its time limit, as the worker would: the text so far, "length"
        assert lines[-1] == "[DONE]"
        final = json.loads(lines[-2])
        assert final["choices"][0]["finish_reason"] == "length"
        assert reference("the cat", 2000).text.startswith(stream.text())
        assert backend.stuck.is_set()
        assert httpx.get(url + "/health").status_code == 200  # slow, not yet stalled

        backend.release()
        wait_until(lambda: scheduler.num_running == 0)
        again = httpx.post(url + "/v1/completions", json=body(max_tokens=10), timeout=CLIENT_TIMEOUT)
        assert again.json()["choices"][0]["text"] == reference("the cat", 10).text
        assert metric(url, 'specdec:request_success_total{finished_reason="timeout"') == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker dies on purpose
def test_a_dead_worker_thread_is_reported_and_its_requests_answered():
    app = make_app(HangingBackend(row_seconds=0.002, seed=7))
    scheduler = app.state.specdec.scheduler
    admit = scheduler._admit
    calls = []

    def admit_then_die():
        calls.append(1)
        if len(calls) > 1 and scheduler.num_waiting:
            raise RuntimeError("a bug in the worker")
        return admit()

    scheduler._admit = admit_then_die
    with serve_in_thread(app) as (url, _):
        stream = Stream(url, body(stream=True))
        wait_until(lambda: len(stream.lines) >= 3)
        queued = httpx.post(url + "/v1/completions", json=body(max_tokens=5), timeout=CLIENT_TIMEOUT)
        assert_openai_error(queued, 503, "backend_stalled")
        assert_error_event(stream.join(), "backend_stalled")
        health = httpx.get(url + "/health").json()
        assert health["status"] == "unhealthy" and "worker thread" in health["reason"]


def test_a_backend_failure_mid_stream_is_one_error_event_then_done():
    backend = HangingBackend(row_seconds=0.001, seed=7)
    app = make_app(backend, n_slots=2)
    with serve_in_thread(app) as (url, _):
        stream = Stream(url, body(stream=True))
        wait_until(lambda: len(stream.lines) >= 4)
        backend.eval_many = lambda requests, prefill=False: (_ for _ in ()).throw(RuntimeError("backend down"))
        error = assert_error_event(stream.join(), "internal_error")
        assert error["param"] is None
        del backend.eval_many

        # The official client raises the event as an APIError carrying the error object.
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT)
        chunks = client.completions.create(model=MODEL, prompt="the cat", max_tokens=2000, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        received = []
        with pytest.raises(openai.APIError) as raised:
            for chunk in chunks:
                received.append(chunk)
                if len(received) == 3:
                    backend.eval_many = lambda requests, prefill=False: (_ for _ in ()).throw(RuntimeError("down"))
        assert raised.value.body["code"] == "internal_error"
        assert len(received) >= 3
