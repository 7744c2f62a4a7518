"""Continuous batching under load: 429 with Retry-After, disconnects cancel and free the slot,
prefix-cache reuse, chunked prefill, the time limit, draining on SIGTERM, metrics."""
import json
import signal
import time

import httpx
import pytest

from fakes.threads import in_thread, wait_until

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "fake"


class SlowFake(FakeBackend):
    """A fake whose target forwards take real time, so requests stay in flight."""

    def __init__(self, delay=0.004, **kw):
        super().__init__(**kw)
        self.delay = delay

    def eval(self, seq_id, start, tokens, *, prefill=False):
        time.sleep(self.delay)
        return super().eval(seq_id, start, tokens, prefill=prefill)


def make_app(n_slots=1, delay=0.004, draft=False, **config):
    engine = Engine(SlowFake(delay, seed=7), FakeBackend(seed=7, noise=0.6) if draft else None, n_slots=n_slots)
    config.setdefault("spec", SpecConfig("ngram", 3))
    return create_app(engine, ServerConfig(served_model_name=MODEL, **config))


def body(prompt="the cat", max_tokens=300, stream=False, **fields):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **fields}


def reference(prompt, max_tokens, chat=False):
    engine = Engine(FakeBackend(seed=7))
    ids = engine.encode_prompt(prompt, chat=chat)
    return engine.generate(GenerationRequest(tuple(ids), max_tokens, SamplingParams(), SpecConfig("off", 0)))




def metric(url, name):
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total




def test_full_queue_answers_429_with_retry_after():
    app = make_app(n_slots=1, max_queue=1, retry_after=3)
    with serve_in_thread(app) as (url, _):
        scheduler = app.state.specdec.scheduler
        first, r1 = in_thread(httpx.post, url + "/v1/completions", json=body(max_tokens=150), timeout=30)
        wait_until(lambda: scheduler.num_running == 1)
        second, r2 = in_thread(httpx.post, url + "/v1/completions", json=body(max_tokens=5), timeout=30)
        wait_until(lambda: scheduler.num_waiting == 1)
        refused = httpx.post(url + "/v1/completions", json=body(max_tokens=5))
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        first.join(30), second.join(30)
        assert r1["value"].status_code == 200 and r2["value"].status_code == 200
        assert httpx.post(url + "/v1/completions", json=body(max_tokens=5)).status_code == 200


def test_stream_disconnect_cancels_and_frees_the_slot():
    app = make_app(n_slots=1)
    with serve_in_thread(app) as (url, _):
        scheduler = app.state.specdec.scheduler
        with httpx.stream("POST", url + "/v1/completions", json=body(max_tokens=2000, stream=True)) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert all(line.startswith("data: ") or line == "" for line in received)
        wait_until(lambda: scheduler.num_running == 0, timeout=5)
        assert metric(url, 'specdec:request_success_total{finished_reason="abort"') == 1
        generated = metric(url, "specdec:generation_tokens_total")
        assert 0 < generated < 2000
        quick = httpx.post(url + "/v1/completions", json=body(max_tokens=5), timeout=10)
        assert quick.status_code == 200


def test_non_streaming_disconnect_cancels_too():
    app = make_app(n_slots=1)
    with serve_in_thread(app) as (url, _):
        scheduler = app.state.specdec.scheduler
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body(max_tokens=2000), timeout=0.3)
        wait_until(lambda: scheduler.num_running == 0, timeout=5)
        assert metric(url, 'specdec:request_success_total{finished_reason="abort"') == 1
        # and its handler ends: one left waiting would hold the engine of its generation (never
        # closed after a build switch) and a place under --limit-concurrency, for good
        wait_until(lambda: scheduler.users.done_with(scheduler.users.generation), timeout=5)


def test_time_limit_cuts_the_generation():
    app = make_app(n_slots=1, request_timeout=0.4)
    with serve_in_thread(app) as (url, _):
        r = httpx.post(url + "/v1/completions", json=body(max_tokens=2000), timeout=30)
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] < 2000
        assert metric(url, 'specdec:request_success_total{finished_reason="timeout"') == 1


def test_prefix_cache_reuses_a_shared_prompt_prefix():
    app = make_app(n_slots=4, delay=0.0, draft=True, spec=SpecConfig("draft", 4))
    system = "the cat sat on the mat " * 12
    with serve_in_thread(app) as (url, _):
        def ask(question):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": messages, "max_tokens": 30, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        first = ask("abc")
        # Another request in between, on another slot, must not evict the shared prefix.
        httpx.post(url + "/v1/completions", json=body(prompt="x y z", max_tokens=5), timeout=30)
        second = ask("hello")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(FakeBackend().tokenize(system))
        assert second["usage"]["speculative"]["cached_prompt_tokens"] == cached
        expected = reference([{"role": "system", "content": system}, {"role": "user", "content": "hello"}], 30, chat=True)
        assert second["choices"][0]["message"]["content"] == expected.text
        assert metric(url, "specdec:prefix_cache_hit_tokens_total") == cached


def test_cache_prompt_false_processes_the_whole_prompt_again():
    app = make_app(n_slots=2, delay=0.0)
    prompt = "the cat sat on the mat " * 20
    with serve_in_thread(app) as (url, _):
        def cached(**extra):
            r = httpx.post(url + "/v1/completions", json=body(prompt=prompt, max_tokens=8, **extra), timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference(prompt, 8).text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached() == 0
        assert cached(cache_prompt=False) == 0  # llama-server's field: nothing reused
        assert cached() > 0  # the default reuses it


def test_chunked_prefill_gives_the_same_text():
    app = make_app(n_slots=2, delay=0.0, draft=True, prefill_chunk=7, spec=SpecConfig("draft", 3))
    prompt = "on the mat the cat sat " * 10
    with serve_in_thread(app) as (url, _):
        r = httpx.post(url + "/v1/completions", json=body(prompt=prompt, max_tokens=40), timeout=30)
        assert r.json()["choices"][0]["text"] == reference(prompt, 40).text
        r = httpx.post(url + "/v1/completions", json=body(prompt=prompt + "abc", max_tokens=40), timeout=30)
        assert r.json()["choices"][0]["text"] == reference(prompt + "abc", 40).text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_sigterm_drains_in_flight_requests():
    app = make_app(n_slots=2)
    with serve_in_thread(app, graceful=20) as (url, server):
        scheduler = app.state.specdec.scheduler
        lines = []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=body(max_tokens=150, stream=True), timeout=30) as r:
                lines.extend(r.iter_lines())

        thread, _ = in_thread(stream)
        wait_until(lambda: scheduler.num_running == 1)
        server.handle_exit(signal.SIGTERM, None)
        assert scheduler.draining
        thread.join(30)
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference("the cat", 150).text


def test_draining_refuses_new_requests():
    app = make_app(n_slots=1)
    with serve_in_thread(app) as (url, _):
        app.state.specdec.scheduler.begin_drain()
        r = httpx.post(url + "/v1/completions", json=body(max_tokens=5))
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/health").status_code == 503


def test_metrics_count_speculation():
    app = make_app(n_slots=2, delay=0.0, draft=True, spec=SpecConfig("draft", 4))
    with serve_in_thread(app) as (url, _):
        r = httpx.post(url + "/v1/completions", json=body(max_tokens=60), timeout=30).json()
        spec = r["usage"]["speculative"]
        assert metric(url, "specdec:spec_decode_num_drafts_total") == spec["draft_rounds"] > 0
        assert metric(url, "specdec:spec_decode_num_draft_tokens_total") == spec["drafted_tokens"]
        assert metric(url, "specdec:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
        assert metric(url, 'specdec:spec_decode_num_accepted_tokens_per_pos_total{method="draft",model_name="fake",'
                           'position="0"}') == spec["accepted_per_position"][0]
        assert metric(url, "specdec:time_to_first_token_seconds_count") == 1
        assert metric(url, "specdec:generation_tokens_total") == 60
        assert metric(url, 'specdec:http_requests_total{route="/v1/completions",status="200"}') == 1


def test_metrics_time_each_output_token():
    """TPOT per request and ITL per token, as serving benchmarks report them."""
    app = make_app(n_slots=1, delay=0.002, spec=SpecConfig("off", 0))
    with serve_in_thread(app) as (url, _):
        httpx.post(url + "/v1/completions", json=body(max_tokens=30), timeout=30)
        assert metric(url, "specdec:request_time_per_output_token_seconds_count") == 1
        assert metric(url, "specdec:inter_token_latency_seconds_count") == 29  # each token after the first
        tpot = metric(url, "specdec:request_time_per_output_token_seconds_sum")
        assert tpot > 0.001 and metric(url, "specdec:inter_token_latency_seconds_sum") == pytest.approx(tpot * 29)


def test_a_long_prompt_joining_does_not_stall_a_running_stream():
    """Its prompt is processed in chunks between the running stream's decode steps."""
    app = make_app(n_slots=2, delay=0.002, prefill_chunk=8)
    engine = app.state.specdec.engine
    long_prompt = "the cat sat on the mat " * 30  # 180 fake tokens: 23 chunks of 8
    with serve_in_thread(app) as (url, _):
        scheduler = app.state.specdec.scheduler
        running, result = in_thread(httpx.post, url + "/v1/completions", json=body(max_tokens=400), timeout=30)
        wait_until(lambda: scheduler.num_running == 1)
        [runner_slot] = engine.core.busy_slots
        engine.target.eval_calls.clear()
        joined = httpx.post(url + "/v1/completions", json=body(prompt=long_prompt, max_tokens=5), timeout=30)
        running.join(30)
        assert joined.status_code == 200 and result["value"].status_code == 200
        assert joined.json()["choices"][0]["text"] == reference(long_prompt, 5).text
    calls = list(engine.target.eval_calls)
    prefills = [i for i, (seq, n) in enumerate(calls) if seq != runner_slot and n == 8]
    assert len(prefills) >= 20
    interleaved = [i for i, (seq, _) in enumerate(calls[prefills[0]:prefills[-1]]) if seq == runner_slot]
    assert len(interleaved) >= len(prefills) - 1  # a decode step of the runner between every two chunks


def test_a_queued_request_whose_client_leaves_is_dropped_from_the_queue():
    app = make_app(n_slots=1, max_queue=4)
    with serve_in_thread(app) as (url, _):
        scheduler = app.state.specdec.scheduler
        running, result = in_thread(httpx.post, url + "/v1/completions", json=body(max_tokens=300), timeout=30)
        wait_until(lambda: scheduler.num_running == 1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body(max_tokens=5), timeout=0.3)
        wait_until(lambda: scheduler.num_waiting == 0, timeout=5)
        assert scheduler.num_running == 1  # the first one goes on
        running.join(30)
        assert result["value"].status_code == 200


def test_a_failing_generation_fails_alone_and_the_server_goes_on():
    app = make_app(n_slots=2, delay=0.001)
    engine = app.state.specdec.engine
    poison = engine.target.tokenize("~~~")
    for slot in engine.slots:
        drafter = slot.drafters["ngram"]
        original = drafter.propose

        def propose(context, k, sampling, rng, guide=None, original=original):
            if list(context[:3]) == poison:
                raise RuntimeError("drafter bug")
            return original(context, k, sampling, rng, guide)

        drafter.propose = propose
    with serve_in_thread(app) as (url, _):
        good, result = in_thread(httpx.post, url + "/v1/completions", json=body(max_tokens=100), timeout=30)
        bad = httpx.post(url + "/v1/completions", json=body(prompt="~~~ the cat", max_tokens=100), timeout=30)
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "internal_error"
        good.join(30)
        assert result["value"].json()["choices"][0]["text"] == reference("the cat", 100).text

        engine.target.eval_many = lambda requests: (_ for _ in ()).throw(RuntimeError("backend down"))
        broken = httpx.post(url + "/v1/completions", json=body(max_tokens=10), timeout=30)
        assert broken.status_code == 500
        del engine.target.eval_many
        again = httpx.post(url + "/v1/completions", json=body(max_tokens=10), timeout=30)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == reference("the cat", 10).text
