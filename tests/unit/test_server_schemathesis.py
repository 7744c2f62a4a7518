"""schemathesis against /openapi.json on a live loopback server (fake backends, small token
limits), with every one of its checks: status codes, response bodies and headers against the
document (server-sent events included, event by event: openapi.py), content types, schema-invalid
requests refused, schema-valid ones accepted. On top of them:
  - whatever it sends, the server never answers 5xx, and every error is OpenAI-shaped;
  - a schema-valid request succeeds unless this model's limits refuse it (context length,
    vocabulary, no FIM tokens for a suffix), which no schema can say;
  - a stream ends in exactly one `[DONE]`, right after one finish_reason chunk per choice (and
    the usage chunk) or one error event; its chunks share one id.

Over 1,000 cases per run (`test_the_fuzzer_ran_enough_cases`). Point it at another server, e.g.
`specdec serve` on the real pair, with SPECDEC_FUZZ_URL=http://127.0.0.1:8000 (and
SPECDEC_FUZZ_API_KEY if it has one).
"""
import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

POST_EXAMPLES = 600  # per completion route
GET_EXAMPLES = 60  # per other operation
MIN_CASES = 1000
# fim_unsupported: a `suffix` on a model without fill-in-the-middle tokens (the fake has none).
# invalid_tools: tools whose names clash (two alike, a tool_choice naming none of them) or whose
# parameters schema the grammar library cannot hold the arguments to, which no schema can say either.
MODEL_LIMIT_CODES = {"context_length_exceeded", "invalid_token_id", "fim_unsupported", "invalid_tools",
                     "unsupported_schema"}  # a JSON Schema the grammar library cannot enforce
ERROR_KEYS = {"message", "type", "param", "code"}
STREAM_EVENTS = 10_000  # more than any stream of this server's (8 tokens, n <= 8) holds

CASES = []  # (method, status, streamed) of every case sent
EXTERNAL = os.environ.get("SPECDEC_FUZZ_URL")  # a server to fuzz instead of the fake one
# The fake answers in milliseconds; the real pair takes seconds per generated answer.
POST_TIMEOUT = 900 if not EXTERNAL else 6 * 3600


@pytest.fixture(scope="module")
def server():
    """(base_url, served model name, headers)."""
    if EXTERNAL:
        key = os.environ.get("SPECDEC_FUZZ_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        model = httpx.get(EXTERNAL + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        yield EXTERNAL, model, headers
        return
    engine = Engine(FakeBackend(seed=7, n_ctx=128), FakeBackend(seed=7, noise=0.6, n_ctx=128), n_slots=2)
    config = ServerConfig(served_model_name="fake", spec=SpecConfig("draft", 3), max_tokens=8, max_queue=16)
    with serve_in_thread(create_app(engine, config)) as (url, _):
        yield url, "fake", {}


@pytest.fixture(scope="module")
def api_schema(server):
    url, _, headers = server
    loaded = schemathesis.openapi.from_url(url + "/openapi.json", headers=headers)
    # schemathesis reads 20 events of a stream by default; n choices of one token per chunk send more.
    loaded.config.max_stream_events = STREAM_EVENTS
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def error_of(response):
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"a {response.status_code} whose body is not JSON: {response.content[:200]!r}")
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error body: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"not an OpenAI error object: {error!r}"
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


@schemathesis.check
def errors_are_openai_shaped(ctx, response, case):
    if response.status_code >= 400:
        error_of(response)
    return None


@schemathesis.check
def valid_requests_succeed(ctx, response, case):
    """schemathesis's positive_data_acceptance (2xx, or a resource that does not exist, or a full
    queue), except that a valid request may meet this model's limits."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code in (404, 429):
        return None
    if response.status_code < 400:
        return None
    if response.status_code == 400 and error_of(response)["code"] in MODEL_LIMIT_CODES:
        return None
    raise AssertionError(f"a schema-valid request got {response.status_code}: {response.content[:300]!r}")


@schemathesis.check
def streams_end_in_done(ctx, response, case):
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    assert not response.stream_cut_short, f"the stream was read only in part ({STREAM_EVENTS} events at most)"
    events = [line[len("data: "):] for line in response.content.decode("utf-8").split("\n\n") if line]
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1], (
        f"no single final [DONE] after {response.elapsed:.2f}s, {len(events)} events: {events[-3:]}")
    payloads = [json.loads(event) for event in events[:-1]]
    errors = [i for i, payload in enumerate(payloads) if "error" in payload]
    if errors:
        assert errors == [len(payloads) - 1], "an error event must be the last event before [DONE]"
        payloads = payloads[:-1]
    # One finish_reason chunk per choice (`n` of them for each prompt), unless an error event ended the stream.
    finals = sorted(choice["index"] for p in payloads for choice in p["choices"] if choice["finish_reason"] is not None)
    n = int((case.body.get("n") if isinstance(case.body, dict) else None) or 1)  # 3.0 is a valid n
    prompt = case.body.get("prompt") if isinstance(case.body, dict) else None
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (int, float)) else 1
    assert finals == ([] if errors else list(range(n * prompts))), f"finish_reason chunks for choices {finals}"
    assert len({p["id"] for p in payloads}) <= 1, "the chunks of one stream carry different ids"
    return None


def run_case(case, server):
    url, model, headers = server
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = model  # reach the generation path (an unknown model is a 404, tested elsewhere)
    response = case.call_and_validate(
        base_url=url, headers=headers, timeout=120,
        excluded_checks=[positive_data_acceptance],
        additional_checks=[errors_are_openai_shaped, valid_requests_succeed, streams_end_in_done])
    streamed = response.headers.get("content-type", [""])[0].startswith("text/event-stream")
    CASES.append((case.operation.method.upper(), response.status_code, streamed))


FUZZ_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.mark.timeout(POST_TIMEOUT)
@schema.include(method="POST").parametrize()
@settings(max_examples=POST_EXAMPLES, **FUZZ_SETTINGS)
def test_completions_survive_anything(case, server):
    run_case(case, server)


@pytest.mark.timeout(300)
@schema.include(method="GET").parametrize()
@settings(max_examples=GET_EXAMPLES, **FUZZ_SETTINGS)
def test_other_routes_survive_anything(case, server):
    run_case(case, server)


def test_the_fuzzer_ran_enough_cases(record_property):
    if not CASES:
        pytest.skip("run with the fuzz tests above")
    statuses = {}
    for _, status, _ in CASES:
        statuses[status] = statuses.get(status, 0) + 1
    streams = sum(1 for _, _, streamed in CASES if streamed)
    record_property("fuzz_cases", len(CASES))
    print(f"\nfuzz: {len(CASES)} cases, statuses {dict(sorted(statuses.items()))}, {streams} answered as event streams")
    assert len(CASES) >= MIN_CASES
    assert not [status for status in statuses if status >= 500]
