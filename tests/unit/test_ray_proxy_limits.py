"""The plain server's key check and body limits in Ray's own HTTP proxy: local Ray (one node of 2
CPUs), 2 replicas of a fake-backend engine, the keys of two tenants (alice with two keys) in the
environment of the Ray processes, as `specdec serve --ray` puts them there. A request without a
valid key is a 401 from the proxy (no replica named), a body over --max-body-bytes a 413, from its
Content-Length or as its chunks pass the limit; each of a tenant's keys lands on one replica; a
full queue is Ray's 429 as an OpenAI error with Retry-After. Ray starts once for the module."""
from __future__ import annotations

import json
import os
import socket
import threading
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from test_ray_serve import FLAGS, MODEL, local_deployment  # noqa: E402

from specdec.config_flags import config_from_args  # noqa: E402
from specdec.deploy.cli import local_ray_environment  # noqa: E402
from specdec.deploy.replica import replica_spec  # noqa: E402
from specdec.server.cli import parse_serve_flags  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ALICE_1, ALICE_2, BOB = "sk-alice-1", "sk-alice-2", "sk-bob"
LIMIT = 20_000
# One slot a replica and a queue of one (per proxy): a third and fourth request at once are too many.
LIMIT_FLAGS = [*FLAGS, "--parallel", "1", "--max-queue", "1", "--max-body-bytes", str(LIMIT)]
START_FAILURES: list[str] = []


@contextmanager
def environment(variables: dict):
    saved = dict(os.environ)
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def endpoint():
    keys = {"SPECDEC_API_KEYS": f"alice {ALICE_1}, alice {ALICE_2}, bob {BOB}"}
    with environment(keys):
        config = config_from_args(parse_serve_flags(LIMIT_FLAGS), keys=True, ray=True)
        # What `specdec serve --ray` gives the local Ray it starts: the body limits (and the keys,
        # here already in the environment).
        with environment(local_ray_environment(config, replica_spec(config))):
            with local_deployment(START_FAILURES, LIMIT_FLAGS) as url:
                yield url


def completion(endpoint, key=None, max_tokens=4, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(endpoint + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": "the cat sat", "max_tokens": max_tokens, "temperature": 0}, **kw)


def openai_error(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_the_proxy_answers_a_missing_key_itself(endpoint):
    for key in (None, "sk-wrong"):
        response = completion(endpoint, key)
        assert response.status_code == 401 and openai_error(response)["code"] == "invalid_api_key"
        assert "x-specdec-replica" not in response.headers  # no replica saw it
    assert httpx.get(endpoint + "/-/healthz", timeout=30).status_code == 200
    assert httpx.get(endpoint + "/health", timeout=30).status_code == 200  # the replica's, open as ever
    assert completion(endpoint, ALICE_1).status_code == 200


def test_the_playground_opens_through_the_proxy_and_its_data_needs_a_key(endpoint):
    page = httpx.get(endpoint + "/", timeout=30)
    assert page.status_code == 200 and "/static/playground.js" in page.text
    assert httpx.get(endpoint + "/static/playground.js", timeout=30).status_code == 200
    assert httpx.get(endpoint + "/v1/specdec/costs", timeout=30).status_code == 401
    costs = httpx.get(endpoint + "/v1/specdec/costs", headers={"Authorization": f"Bearer {BOB}"}, timeout=30)
    assert costs.status_code == 200 and costs.json()["calibrated"]


def test_a_body_over_the_limit_is_a_413_from_the_proxy(endpoint):
    big = json.dumps({"model": MODEL, "prompt": "x" * LIMIT, "max_tokens": 1}).encode()
    response = httpx.post(endpoint + "/v1/completions", headers={"Authorization": f"Bearer {BOB}"}, content=big,
                          timeout=30)
    assert response.status_code == 413 and openai_error(response)["code"] == "request_too_large"
    assert "x-specdec-replica" not in response.headers and response.headers["connection"] == "close"
    # Chunked: the proxy answers once the bytes pass the limit, before the body ends.
    url = urlsplit(endpoint)
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {BOB}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"x" * 4096
        for _ in range(LIMIT // len(chunk) + 1):
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = conn.recv(65536)
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_every_key_of_a_tenant_lands_on_the_tenants_replica(endpoint):
    alice = {completion(endpoint, key).headers["x-specdec-replica"] for key in (ALICE_1, ALICE_2) * 3}
    assert len(alice) == 1
    assert len({completion(endpoint, BOB).headers["x-specdec-replica"] for _ in range(3)}) == 1


def test_a_full_queue_is_an_openai_429_with_retry_after(endpoint):
    responses: list[httpx.Response] = []
    lock = threading.Lock()

    def ask(key):
        response = completion(endpoint, key, max_tokens=200)  # 10 ms a token: 2 s in a slot
        with lock:
            responses.append(response)

    threads = [threading.Thread(target=ask, args=(key,)) for key in (ALICE_1, BOB) * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [r for r in responses if r.status_code != 200]
    assert refused, [r.status_code for r in responses]
    for response in refused:
        error = openai_error(response)
        assert (response.status_code, error["type"], error["code"]) == (429, "rate_limit_error", "queue_full")
        assert response.headers["retry-after"] == "1" and "backpressure" in error["message"]
