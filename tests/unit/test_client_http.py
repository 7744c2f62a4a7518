"""The HTTP client against the fault-injecting server: retries, Retry-After, typed errors, timeouts,
streaming. Backoff sleeps are injected, so no test waits for real backoff."""
from __future__ import annotations

import asyncio
import random
import time
from email.utils import format_datetime
from datetime import datetime, timedelta, timezone

import pytest

from fakes.openai_server import FakeServer, FakeServerConfig
from specdec.client import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    RetryPolicy,
    Timeouts,
    chat_body,
    completion_body,
    speculative_decoding_field,
)
from specdec.client.http import parse_retry_after, status_error

pytestmark = pytest.mark.timeout(30)
MODEL = "fake-model"


@pytest.fixture
def server():
    with FakeServer(FakeServerConfig()) as running:
        yield running


class Sleeps(list):
    """Records the waits a client asks for instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def make_client(server, sleeps=None, **kwargs) -> Client:
    return Client(server.base_url, sleep=sleeps if sleeps is not None else Sleeps(), rng=random.Random(0), **kwargs)


def ask(text: str, **fields) -> dict:
    return chat_body([{"role": "user", "content": text}], MODEL, **fields)


# -- pure parts ----------------------------------------------------------------------------------------

def test_retry_after_parsing():
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after": "0.25"}) == 0.25
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert parse_retry_after({}) is None
    assert parse_retry_after({"retry-after": "soon"}) is None
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    date = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after({"retry-after": date}, now=now.timestamp()) == pytest.approx(30.0)


def test_backoff_is_exponential_with_jitter_and_bounded():
    policy = RetryPolicy(max_attempts=6, backoff_base=0.5, backoff_max=3.0)
    rng = random.Random(1)
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (5, 3.0)]:
        delays = [policy.delay(attempt, None, rng) for _ in range(200)]
        assert all(ceiling / 2 <= d < ceiling for d in delays)
        assert max(delays) - min(delays) > ceiling / 4  # jittered, not constant
    assert policy.delay(6, None, rng) is None  # the last attempt is final


def test_retry_after_is_never_shortened():
    policy = RetryPolicy(max_attempts=3, max_retry_after=60)
    rng = random.Random(2)
    assert all(7.0 <= policy.delay(1, 7.0, rng) <= 7.7 for _ in range(100))
    assert policy.delay(1, 61.0, rng) is None  # beyond the limit: give up rather than come back early


def test_timeout_scales_with_max_tokens():
    timeouts = Timeouts(connect=2, first_token=10, per_token=0.5)
    assert timeouts.request_seconds(100) == 2 + 10 + 50
    assert timeouts.request_seconds(None) == 2 + 10 + 0.5 * timeouts.default_max_tokens
    assert Timeouts(total=7).request_seconds(100000) == 7


def test_speculative_field_mapping():
    assert speculative_decoding_field("on") is True
    assert speculative_decoding_field("off") is False
    assert speculative_decoding_field("draft") == {"method": "draft"}
    assert ask("x", speculative="ngram")["speculative_decoding"] == {"method": "ngram"}


def test_status_error_carries_the_openai_error():
    body = b'{"error": {"message": "max_tokens too large", "type": "invalid_request_error", "param": "max_tokens", "code": null}}'
    err = status_error(400, body, {})
    assert isinstance(err, BadRequestError) and not err.retryable
    assert (err.message, err.type, err.param, err.status_code) == ("max_tokens too large", "invalid_request_error",
                                                                    "max_tokens", 400)
    assert "max_tokens too large" in str(err)
    assert isinstance(status_error(502, b"<html>bad gateway</html>", {}), InternalServerError)
    assert status_error(502, b"<html>bad gateway</html>", {}).message == "<html>bad gateway</html>"
    assert isinstance(status_error(429, b"{}", {"retry-after": "2"}), RateLimitError)
    assert status_error(429, b"{}", {"retry-after": "2"}).retry_after == 2.0


# -- against the fake server ---------------------------------------------------------------------------

def test_plain_chat_and_completion(server):
    with make_client(server) as client:
        assert client.models() == [MODEL]
        result = client.chat(ask("hello", max_tokens=4))
        assert result.text == "t0 t1 t2 t3 "
        assert result.usage["completion_tokens"] == 4
        assert result.usage["speculative"]["method"] == "ngram"
        assert [a.status_code for a in result.attempts] == [200]
        assert result.ttft_seconds is None
        done = client.completions(completion_body("complete", MODEL, max_tokens=3, speculative="off"))
        assert done.text == "t0 t1 t2 " and "speculative" not in done.usage


def test_retries_429_5xx_and_drops_until_success(server):
    sleeps = Sleeps()
    with make_client(server, sleeps) as client:
        result = client.chat(ask("x [[faults: 429, 500, drop, 503]]"))
    assert result.text.startswith("t0")
    codes = [a.status_code for a in result.attempts]
    assert codes == [429, 500, None, 503, 200]
    assert "RemoteProtocolError" in result.attempts[2].error
    assert [a.error is None for a in result.attempts] == [False] * 4 + [True]
    assert len(sleeps) == 4 and [a.wait_seconds for a in result.attempts[:4]] == sleeps
    assert len(server.requests) == 5


def test_backoff_honours_retry_after(server):
    sleeps = Sleeps()
    with make_client(server, sleeps) as client:
        result = client.chat(ask("x [[faults: 429:5, 429:2]]"))
    assert len(result.attempts) == 3
    assert [a.retry_after for a in result.attempts[:2]] == [5.0, 2.0]
    assert 5.0 <= sleeps[0] <= 5.5 and 2.0 <= sleeps[1] <= 2.2


def test_429_burst(server):
    server.config.burst_429 = 3
    sleeps = Sleeps()
    with make_client(server, sleeps) as client:
        result = client.chat(ask("burst"))
    assert [a.status_code for a in result.attempts] == [429, 429, 429, 200]
    assert all(s >= 0.01 for s in sleeps)


def test_no_retry_on_400_and_the_message_is_the_servers(server):
    sleeps = Sleeps()
    with make_client(server, sleeps) as client, pytest.raises(BadRequestError) as info:
        client.chat(ask("bad [[always: 400]]"))
    err = info.value
    assert err.message == "messages must not be empty" and err.param == "messages" and err.status_code == 400
    assert len(err.attempts) == 1 and sleeps == [] and len(server.requests) == 1


def test_unknown_model_is_404_without_retry(server):
    with make_client(server) as client, pytest.raises(NotFoundError) as info:
        client.chat(chat_body([{"role": "user", "content": "x"}], "no-such-model"))
    assert "no-such-model" in info.value.message and len(server.requests) == 1


def test_auth(server):
    server.config.api_key = "sekrit"
    with make_client(server) as client, pytest.raises(AuthenticationError):
        client.models()
    with make_client(server, api_key="sekrit") as client:
        assert client.models() == [MODEL]


def test_attempts_are_bounded_and_all_recorded(server):
    sleeps = Sleeps()
    with make_client(server, sleeps, retry=RetryPolicy(max_attempts=3)) as client:
        with pytest.raises(InternalServerError) as info:
            client.chat(ask("down [[always: 500]]"))
    assert [a.number for a in info.value.attempts] == [1, 2, 3]
    assert [a.status_code for a in info.value.attempts] == [500, 500, 500]
    assert info.value.attempts[-1].wait_seconds is None and len(sleeps) == 2
    assert len(server.requests) == 3


def test_slow_response_times_out_and_is_retried(server):
    server.config.slow_seconds = 1.5
    with make_client(server, retry=RetryPolicy(max_attempts=2), timeouts=Timeouts(total=0.3)) as client:
        started = time.monotonic()
        with pytest.raises(APITimeoutError) as info:
            client.chat(ask("slow [[always: slow]]"))
        assert time.monotonic() - started < 2.5  # two 0.3 s attempts, not two of the server's 1.5 s
    assert len(info.value.attempts) == 2 and all(0.25 < a.elapsed_seconds < 1.2 for a in info.value.attempts)
    # A slow first attempt, then a fast one: the request succeeds.
    with make_client(server, timeouts=Timeouts(total=0.3)) as client:
        assert client.chat(ask("slow once [[faults: slow]]")).attempts[-1].status_code == 200


def test_connection_refused_is_retried_then_raised():
    sleeps = Sleeps()
    with Client("http://127.0.0.1:9/v1", sleep=sleeps, retry=RetryPolicy(max_attempts=2)) as client:
        with pytest.raises(APIConnectionError) as info:
            client.models()
    assert len(info.value.attempts) == 2 and len(sleeps) == 1


def test_stream_yields_deltas_and_usage(server):
    with make_client(server) as client:
        stream = client.stream_chat(ask("stream me", max_tokens=5, speculative="draft"))
        deltas = list(stream)
    assert deltas == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
    done = stream.completion
    assert done.text == "".join(deltas) and done.finish_reason == "length"
    assert done.usage["speculative"]["method"] == "draft"
    assert done.ttft_seconds is not None and done.ttft_seconds <= done.latency_seconds


def test_stream_retries_before_the_first_delta_but_not_after(server):
    server.config.drop_after_chunks = 0
    with make_client(server) as client:
        stream = client.stream_chat(ask("early drop [[faults: 429, drop]]"))
        assert "".join(stream) == "t0 t1 t2 t3 t4 t5 t6 t7 "
        assert [a.status_code for a in stream.completion.attempts] == [429, None, 200]
    server.config.drop_after_chunks = 3
    with make_client(server) as client:
        stream = client.stream_chat(ask("late drop [[faults: drop]]"))
        got = []
        with pytest.raises(APIConnectionError) as info:
            for delta in stream:
                got.append(delta)
    assert got == ["t0 ", "t1 ", "t2 "]  # what was handed out is never repeated
    assert len(info.value.attempts) == 1


def test_collected_stream_restarts_after_a_drop(server):
    with make_client(server) as client:
        result = client.chat(ask("drop then ok [[faults: drop, drop]]", max_tokens=6), stream=True)
    assert result.text == "t0 t1 t2 t3 t4 t5 "  # no text of the dropped attempts leaks in
    assert [a.status_code for a in result.attempts] == [None, None, 200]
    assert result.ttft_seconds is not None and result.usage["completion_tokens"] == 6


def test_stream_past_its_deadline_times_out(server):
    server.config.token_delay = 0.1
    with make_client(server, retry=RetryPolicy(max_attempts=1), timeouts=Timeouts(total=0.35)) as client:
        with pytest.raises(APITimeoutError):
            client.chat(ask("trickle", max_tokens=8, speculative="off"), stream=True)


def test_async_client_matches(server):
    waits = []

    async def fake_sleep(seconds):
        waits.append(seconds)

    async def main():
        async with AsyncClient(server.base_url, sleep=fake_sleep, rng=random.Random(0)) as client:
            assert await client.models() == [MODEL]
            plain = await client.chat(ask("a [[faults: 429:3, 500]]"))
            streamed = await client.chat(ask("b [[faults: drop]]", max_tokens=4), stream=True)
            stream = client.stream_chat(ask("c", max_tokens=3))
            deltas = [d async for d in stream]
            with pytest.raises(BadRequestError):
                await client.completions(completion_body("d [[always: 400]]", MODEL))
            return plain, streamed, deltas, stream.completion

    plain, streamed, deltas, completion = asyncio.run(main())
    assert [a.status_code for a in plain.attempts] == [429, 500, 200] and waits[0] >= 3.0
    assert streamed.text == "t0 t1 t2 t3 " and len(streamed.attempts) == 2
    assert deltas == ["t0 ", "t1 ", "t2 "] and completion.usage["completion_tokens"] == 3
    assert len(waits) == 3  # 429, 500, drop; none for the 400


def test_many_concurrent_requests_under_faults_each_end_once(server):
    """Every request ends ok or with a recorded error; the server saw exactly the attempts recorded."""
    faults = ["", "[[faults: 429]]", "[[faults: 500, drop]]", "[[always: 400]]", "[[faults: drop]]",
              "[[always: 503]]"]

    async def fake_sleep(seconds):
        await asyncio.sleep(0)

    async def one(client, i):
        try:
            return await client.chat(ask(f"q{i} {faults[i % len(faults)]}"), stream=i % 2 == 0)
        except Exception as exc:  # noqa: BLE001 - the outcome is what we check
            return exc

    async def main():
        async with AsyncClient(server.base_url, sleep=fake_sleep, retry=RetryPolicy(max_attempts=3)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(36)))

    outcomes = asyncio.run(main())
    recorded = 0
    for i, outcome in enumerate(outcomes):
        kind = faults[i % len(faults)]
        if "always" in kind:
            assert isinstance(outcome, (BadRequestError, InternalServerError)), outcome
        else:
            assert outcome.text == "t0 t1 t2 t3 t4 t5 t6 t7 ", outcome
        recorded += len(outcome.attempts)
    assert recorded == len(server.requests)
