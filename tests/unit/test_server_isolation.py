"""No request hurts another (issue 42), on the server's side: /metrics needs a key of its own once
tenants have keys; /health answers beyond the connection limit; bad numbers and deep schemas are
400s after which the same keep-alive connection serves the next request."""
import json
import socket
import time

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.config import load_config
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecdecError

pytestmark = pytest.mark.timeout(60)

MODEL = "fake"
FIM_PIECES = [b"<|fim_prefix|>", b"<|fim_suffix|>", b"<|fim_middle|>", b"<|fim_pad|>", b"<|repo_name|>",
              b"<|file_sep|>"]
TENANTS = (("key-a", "tenant-a"), ("key-b", "tenant-b"))
HUGE = int("9" * 400)


def make_app(**config):
    engine = Engine(FakeBackend(seed=7, extra_special_pieces=FIM_PIECES), n_slots=2)
    return create_app(engine, ServerConfig(served_model_name=MODEL, **config))


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def chat_body(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3,
            "temperature": 0, **fields}


# -- /metrics --------------------------------------------------------------------------------------
def test_metrics_key_reads_metrics_and_tenant_keys_do_not():
    with serve_in_thread(make_app(api_keys=TENANTS, metrics_key="scrape-key")) as (url, _):
        assert httpx.get(url + "/metrics", headers=bearer("scrape-key"), timeout=5).status_code == 200
        assert httpx.get(url + "/metrics", headers={"x-api-key": "scrape-key"}, timeout=5).status_code == 200
        error = openai_error(httpx.get(url + "/metrics", headers=bearer("key-a"), timeout=5), 403)
        assert error["code"] == "metrics_key_required" and "--metrics-key" in error["message"]
        assert openai_error(httpx.get(url + "/metrics", timeout=5), 401)["code"] == "invalid_api_key"
        # the metrics key is no tenant's: it opens nothing else
        assert openai_error(httpx.get(url + "/v1/models", headers=bearer("scrape-key"), timeout=5), 401)
        assert httpx.get(url + "/v1/models", headers=bearer("key-b"), timeout=5).status_code == 200
        assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_several_tenants_without_a_metrics_key_cannot_read_each_others_traffic():
    with serve_in_thread(make_app(api_keys=TENANTS)) as (url, _):
        error = openai_error(httpx.get(url + "/metrics", headers=bearer("key-a"), timeout=5), 403)
        assert "--metrics-key" in error["message"] and "--public-metrics" in error["message"]
    with serve_in_thread(make_app(api_key="only-key")) as (url, _):  # one tenant: its own traffic only
        assert httpx.get(url + "/metrics", headers=bearer("only-key"), timeout=5).status_code == 200
    with serve_in_thread(make_app(api_keys=TENANTS, public_metrics=True)) as (url, _):
        assert httpx.get(url + "/metrics", timeout=5).status_code == 200


def test_metrics_key_from_the_flag_or_its_variable_never_a_file_and_never_a_tenants():
    config = load_config(flags={"server.metrics_key": "m-key"}, environ={"SPECDEC_API_KEYS": "a key-a"}, keys=True)
    assert config.server.metrics_key == "m-key" and "m-key" not in repr(config.server)
    config = load_config(environ={"SPECDEC_METRICS_KEY": "m-env", "SPECDEC_API_KEY": "k"}, keys=True)
    assert config.server.metrics_key == "m-env"
    with pytest.raises(SpecdecError, match="server.metrics_key cannot be set"):
        load_config(sets=["server.metrics_key=x"], environ={}, keys=True)
    with pytest.raises(SpecdecError, match="tenant's API key"):
        load_config(environ={"SPECDEC_METRICS_KEY": "key-a", "SPECDEC_API_KEYS": "a key-a"}, keys=True)


def test_metrics_key_flag_sets_the_configuration():
    from specdec.config_flags import config_from_args
    from specdec.server.cli import parse_serve_flags

    args = parse_serve_flags(["--metrics-key", "m-flag", "--served-model-name", "x"])
    assert config_from_args(args, keys=True).server.metrics_key == "m-flag"


# -- /health beyond the connection limit ------------------------------------------------------------
def test_health_answers_while_slow_bodies_hold_every_connection():
    app = make_app(limit_concurrency=3, body_timeout=30.0, header_timeout=30.0)
    with serve_in_thread(app) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n{").encode()
        held = []
        try:
            for _ in range(3):  # each a request whose body never comes
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(head)
                held.append(sock)
            time.sleep(0.3)
            started = time.monotonic()
            health = httpx.get(url + "/health", timeout=2)
            assert health.status_code == 200 and time.monotonic() - started < 1.0
            refused = httpx.post(url + "/v1/chat/completions", json=chat_body(), timeout=5)
            error = openai_error(refused, 503)
            assert error["code"] == "too_many_connections" and refused.headers["connection"] == "close"
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 5
        while httpx.post(url + "/v1/chat/completions", json=chat_body(), timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the limit was not released"
            time.sleep(0.05)


# -- 400s, and the connection serves on ---------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with serve_in_thread(make_app()) as (url, _):
        yield url


def bad_then_good(url, path, bad, good, param):
    """`bad` (a body, or its JSON text) is a 400 naming `param`; the same keep-alive connection
    then answers `good`."""
    with httpx.Client(base_url=url, timeout=30) as client:
        sent = {"content": bad, "headers": {"Content-Type": "application/json"}} if isinstance(bad, str) else {"json": bad}
        error = openai_error(client.post(path, **sent), 400)
        assert error["param"] == param, error
        assert client.post(path, json=good).status_code == 200


@pytest.mark.parametrize("field", ["t_max_predict_ms", "t_max_prompt_ms", "repeat_last_n", "penalty_last_n",
                                   "dry_allowed_length", "dry_penalty_last_n", "n_keep", "n_discard"])
def test_infill_integers_too_large_are_400s(server, field):
    good = {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 2, "temperature": 0}
    bad_then_good(server, "/infill", {**good, field: HUGE}, good, field)


def with_deep_schema(body):
    """`body` as JSON text with a response_format schema nested 950 deep (json.dumps would overflow)."""
    deep = '{"type": "array", "items": ' * 950 + '{"type": "string"}' + "}" * 950
    form = '{"type": "json_schema", "json_schema": {"name": "deep", "schema": %s}}' % deep
    return json.dumps(body)[:-1] + ', "response_format": ' + form + "}"


def test_deep_response_format_schema_is_a_400_and_the_connection_serves_on(server):
    param = "response_format.json_schema.schema"
    bad_then_good(server, "/v1/chat/completions", with_deep_schema(chat_body()), chat_body(), param)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad_then_good(server, "/v1/chat/completions", with_deep_schema(chat_body(tools=[tool])), chat_body(), param)
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    bad_then_good(server, "/v1/completions", with_deep_schema(completion), completion, param)
