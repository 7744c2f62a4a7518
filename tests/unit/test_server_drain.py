"""SIGTERM to a real `specdec serve` process (fake models with a real forward's timing), under
load: the requests in flight finish with the right text; new ones are answered 503 (not refused)
until the socket closes; a drain that outlasts its grace period, or a second signal, ends the
streams still running with the shutting_down error event — never a finish_reason "length"."""
import json
import signal
import threading
import time

import httpx
import pytest
from fakes.fake_serve import serving

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

pytestmark = pytest.mark.timeout(120)

COSTS = {"forward": 0.002, "row": 0.006, "prompt_row": 0.0005}  # seconds per fake forward
PROMPTS = ["the cat", "on the mat", "sat sat", "abc abc", "x y z", "hello there"]


def reference(prompt, max_tokens):
    engine = Engine(FakeBackend(seed=7))
    ids = engine.encode_prompt(prompt, chat=False)
    return engine.generate(GenerationRequest(tuple(ids), max_tokens, SamplingParams(), SpecConfig("off", 0))).text


def body(prompt, max_tokens, stream=True):
    return {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def read_stream(url, request, out):
    """Reads one streaming request into `out`: status, data lines, the time [DONE] arrived."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=60) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                response.read()
                out["error"] = response.json()["error"]
                return
            out["lines"] = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            out["done_at"] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out["exception"] = exc


def start_streams(url, requests):
    results = [{} for _ in requests]
    threads = [threading.Thread(target=read_stream, args=(url, request, out), daemon=True)
               for request, out in zip(requests, results)]
    for thread in threads:
        thread.start()
    return threads, results


def text_of(lines):
    return "".join(json.loads(line)["choices"][0]["text"] for line in lines if line.startswith('{"id"'))


def wait_for(url, running, waiting, timeout=20):
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        if health.get("running") == running and health.get("waiting") == waiting:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.02)


def probe_until_refused(url, timeout=60):
    """From now until the socket closes: alternately /health and a new completion; returns
    [(kind, status or "refused", body)] in order."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for kind in ("health", "completion"):
            try:
                if kind == "health":
                    response = httpx.get(url + "/health", timeout=5)
                else:
                    response = httpx.post(url + "/v1/completions", json=body("new", 5, stream=False), timeout=5)
                seen.append((kind, response.status_code, response.json()))
            except httpx.ConnectError:
                seen.append((kind, "refused", None))
        if seen[-1][1] == "refused" and seen[-2][1] == "refused":
            return seen
        time.sleep(0.02)
    raise AssertionError("the server never closed its socket")


def test_sigterm_under_load_finishes_in_flight_requests_and_answers_503_until_the_socket_closes():
    flags = ["--model", "fake.gguf", "--parallel", "4", "--max-queue", "8", "--method", "off",
             "--drain-grace", "60", "--log-level", "warning"]
    with serving(flags, COSTS) as (url, process):
        requests = [body(prompt, 60 + 10 * i) for i, prompt in enumerate(PROMPTS)]
        threads, results = start_streams(url, requests)
        wait_for(url, running=4, waiting=2)  # two of them queue for a slot
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        probes = probe_until_refused(url)
        closed_after = time.monotonic() - signalled
        for thread in threads:
            thread.join(60)
        assert process.wait(30) in (0, -signal.SIGTERM)

    for request, result in zip(requests, results):  # every request in flight finished, whole
        assert result.get("status") == 200 and "exception" not in result, result
        assert result["lines"][-1] == "[DONE]"
        assert json.loads(result["lines"][-2])["choices"][0]["finish_reason"] == "length"
        assert text_of(result["lines"]) == reference(request["prompt"], request["max_tokens"])
    statuses = [status for _, status, _ in probes]
    first_refused = statuses.index("refused")
    assert first_refused > 0 and all(status == 503 for status in statuses[:first_refused])
    assert all(status == "refused" for status in statuses[first_refused:])  # closed for good, not flapping
    answered = probes[:first_refused]
    print(f"\ndrain: {len(requests)} requests in flight finished whole; {len(answered)} new requests answered 503 "
          f"during the drain; socket closed about {closed_after:.1f}s after SIGTERM")
    assert {kind for kind, _, _ in answered} == {"health", "completion"}
    for kind, _, payload in answered:
        if kind == "health":
            assert payload["status"] == "draining" and payload["reason"]
        else:
            assert set(payload["error"]) == {"message", "type", "param", "code"}
            assert payload["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("how", ["grace period", "second signal"])
def test_a_drain_cut_short_ends_running_streams_with_the_error_event(how):
    grace = "1" if how == "grace period" else "60"
    flags = ["--model", "fake.gguf", "--parallel", "1", "--method", "off", "--drain-grace", grace,
             "--log-level", "warning"]
    with serving(flags, COSTS) as (url, process):
        threads, (running,) = start_streams(url, [body("the cat", 2000)])
        wait_for(url, running=1, waiting=0)
        more, (queued,) = start_streams(url, [body("sat sat", 50)])
        wait_for(url, running=1, waiting=1)
        threads += more
        process.send_signal(signal.SIGTERM)
        if how == "second signal":
            time.sleep(0.5)
            assert running.get("lines") is None  # still streaming: the drain goes on
            process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert process.wait(30) in (0, -signal.SIGTERM)

    lines = running["lines"]  # cut mid-stream: one error event, then [DONE]; no finish_reason chunk
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    assert json.loads(lines[-2]) == {"error": {"message": "the server is shutting down.", "type": "server_error",
                                               "param": None, "code": "shutting_down"}}
    chunks = [json.loads(line) for line in lines[:-2]]
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    assert reference("the cat", 2000).startswith(text_of(lines[:-2])) and len(chunks) > 5
    assert queued["status"] == 503 and queued["error"]["code"] == "shutting_down"  # never started
