"""Hostile clients through real HTTP against the real uvicorn protocol (connections.py): oversized,
chunked and slow bodies, slow headers, unparsable JSON, oversized prompts refused before
tokenizing, duplicated headers, foreign Hosts, keys and /metrics, stalled stream readers, queued
streams kept alive, many connections at once; and streams of one token per chunk.

(Special-token text in content is tests/unit/test_role_safety.py's.)"""
import codecs
import json
import select
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.hosts import allowed_hosts_for
from specdec.server.pieces import TokenPieces
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "fake"
KIB = 1024
MAX_BODY = 64 * KIB
N_CTX = 256  # so a prompt of more than 256 x 64 bytes cannot fit


class SlowFake(FakeBackend):
    """A fake whose forwards take `delay` seconds once a test sets it (start-up calibration stays fast)."""

    delay = 0.0

    def eval(self, *args, **kwargs):
        if self.delay:
            time.sleep(self.delay)
        return super().eval(*args, **kwargs)


def make_app(engine=None, **config):
    engine = engine or Engine(FakeBackend(seed=7, n_ctx=N_CTX), n_slots=2)
    return create_app(engine, ServerConfig(served_model_name=MODEL, **config))


@pytest.fixture(scope="module")
def limited():
    """(url, app): a loopback server with small limits and the loopback Host allow-list."""
    app = make_app(max_body_bytes=MAX_BODY, body_timeout=1.0, header_timeout=1.0,
                   allowed_hosts=allowed_hosts_for("127.0.0.1"))
    with serve_in_thread(app) as (url, _):
        yield url, app


@pytest.fixture(scope="module")
def keyed():
    app = make_app(api_keys=(("key-a", "tenant-a"), ("key-b", "tenant-b")))
    with serve_in_thread(app) as (url, _):
        yield url


# -- helpers ---------------------------------------------------------------------------------------
def address(url):
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def request_head(method, path, headers=(), host="127.0.0.1"):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *headers, "", ""]
    return "\r\n".join(lines).encode("latin-1")


def read_until_closed(sock, timeout=5.0):
    """Everything the server sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            part = sock.recv(65536)
            if not part:
                return data
            data += part
    except (socket.timeout, ConnectionResetError):
        return data


def parse_response(data):
    """(status, headers, body) of a raw HTTP/1.1 response."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def raw(url, data, timeout=5.0):
    with socket.create_connection(address(url), timeout=timeout) as sock:
        sock.sendall(data)
        return parse_response(read_until_closed(sock, timeout))


def assert_openai_error(status, body, expected_status, code=None):
    assert status == expected_status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    return error


def assert_healthy(url):
    response = httpx.get(url + "/health", timeout=1.0)
    assert response.status_code == 200 and response.json()["status"] == "ok"


def chat_body(content="the cat", **fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **fields}


def post_raw_json(url, body: bytes):
    head = request_head("POST", "/v1/chat/completions", ["Content-Type: application/json",
                                                          f"Content-Length: {len(body)}", "Connection: close"])
    return raw(url, head + body)


# -- bodies ----------------------------------------------------------------------------------------
def test_content_length_over_the_limit_is_a_413_before_the_body_is_sent(limited):
    url, _ = limited
    head = request_head("POST", "/v1/chat/completions", ["Content-Type: application/json",
                                                          f"Content-Length: {100 * MAX_BODY}"])
    status, headers, body = raw(url, head)  # not a byte of the body: the answer comes from the header
    assert_openai_error(status, body, 413, "request_too_large")
    assert headers["connection"] == "close"
    assert_healthy(url)


def test_chunked_body_over_the_limit_is_a_413(limited):
    url, _ = limited
    chunk = b"x" * (16 * KIB)
    with socket.create_connection(address(url), timeout=5) as sock:
        sock.sendall(request_head("POST", "/v1/chat/completions", ["Content-Type: application/json",
                                                                   "Transfer-Encoding: chunked"]))
        answered = False
        for _ in range(4 * MAX_BODY // len(chunk)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if select.select([sock], [], [], 0.2)[0]:  # answered as soon as the bytes passed the limit
                answered = True
                break
        assert answered, "no answer to a chunked body 4x over the limit"
        status, headers, body = parse_response(read_until_closed(sock))
    assert_openai_error(status, body, 413, "request_too_large")
    assert_healthy(url)


def test_slow_upload_is_a_408(limited):
    url, _ = limited
    started = time.monotonic()
    with socket.create_connection(address(url), timeout=5) as sock:
        sock.sendall(request_head("POST", "/v1/chat/completions", ["Content-Type: application/json",
                                                                   "Content-Length: 1000"]))
        answered = False
        for _ in range(20):  # one byte every 0.25 s: 1000 bytes would take minutes
            sock.sendall(b" ")
            if select.select([sock], [], [], 0.25)[0]:
                answered = True
                break
        assert answered, "a body trickling in for 5 s past a 1 s body timeout got no answer"
        status, headers, body = parse_response(read_until_closed(sock))
    assert_openai_error(status, body, 408, "request_timeout")
    assert headers["connection"] == "close"
    assert time.monotonic() - started < 5
    assert_healthy(url)


def test_slow_headers_are_cut_at_the_header_timeout(limited):
    """Slowloris: one header byte every 0.2 s; the 1 s header timeout closes the connection."""
    url, _ = limited
    started = time.monotonic()
    with socket.create_connection(address(url), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for byte in b"X-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if select.select([sock], [], [], 0.2)[0]:
                closed = read_until_closed(sock, 1.0) == b""  # closed, with no response
                break
    assert closed, "the server kept a connection whose headers never ended"
    assert time.monotonic() - started < 5
    assert_healthy(url)


@pytest.mark.parametrize("body", [
    b'{"model": "fake", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "fake", "messages": [{"role": "user", "content": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}]}",
    b'{"model": "fake", "messages": [{"role": "user", "content": "caf\xc3 \xff\xfe"}]}',
    b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}",
], ids=["deep-array", "deep-object", "invalid-utf8", "5000-digit-int"])
def test_unparsable_bodies_are_400s(limited, body):
    url, _ = limited
    status, _, response = post_raw_json(url, body)
    assert_openai_error(status, response, 400, "invalid_json")
    assert_healthy(url)


def test_a_prompt_over_the_byte_limit_is_refused_before_tokenizing(limited, monkeypatch):
    url, app = limited
    target = app.state.specdec.engine.target
    calls = []
    tokenize = target.tokenize
    monkeypatch.setattr(target, "tokenize", lambda *a, **kw: calls.append(1) or tokenize(*a, **kw))
    big = "the cat " * (N_CTX * 64 // 8 + 1)  # more bytes than N_CTX tokens of 64 bytes
    for path, body, param in [("/v1/chat/completions", chat_body(big), "messages"),
                              ("/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 4}, "prompt")]:
        response = httpx.post(url + path, json=body, timeout=10)
        error = assert_openai_error(response.status_code, response.content, 400, "context_length_exceeded")
        assert error["param"] == param
    assert calls == []
    assert httpx.post(url + "/v1/chat/completions", json=chat_body(), timeout=10).status_code == 200
    assert calls  # the spy sees the tokenizer when it is called


# -- headers ---------------------------------------------------------------------------------------
def test_duplicated_host_header_is_a_400(limited):
    url, _ = limited
    status, _, _ = raw(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"
                            b"Connection: close\r\n\r\n")
    assert status == 400


def test_headers_still_arriving_past_the_limit_are_a_400(limited):
    """h11 bounds the bytes of a request head still incomplete (16 KiB by default); a complete head
    that arrives in one read is bounded by the read's size instead."""
    url, _ = limited
    with socket.create_connection(address(url), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (32 * KIB))  # no end yet
        status, _, _ = parse_response(read_until_closed(sock))
    assert status == 400
    assert_healthy(url)


def test_duplicated_authorization_header_is_a_400(keyed, limited):
    for url in (keyed, limited[0]):  # with keys or without: the key check and the tenant could differ
        head = request_head("GET", "/v1/models", ["Authorization: Bearer key-a", "Authorization: Bearer key-b",
                                                  "Connection: close"])
        status, _, body = raw(url, head)
        assert_openai_error(status, body, 400, "duplicate_header")


def test_a_foreign_host_is_a_421_on_a_loopback_server(limited):
    url, _ = limited
    port = address(url)[1]
    response = httpx.get(url + "/health", headers={"Host": f"attacker.example:{port}"}, timeout=5)
    assert_openai_error(response.status_code, response.content, 421, "invalid_host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", "LOCALHOST."):
        assert httpx.get(url + "/health", headers={"Host": host}, timeout=5).status_code == 200, host


def test_keys_lowercase_bearer_and_metrics(keyed):
    url = keyed
    assert httpx.get(url + "/health", timeout=5).status_code == 200  # open
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"{scheme} key-b"}, timeout=5).status_code == 200
    response = httpx.get(url + "/metrics", timeout=5)
    assert_openai_error(response.status_code, response.content, 401, "invalid_api_key")
    response = httpx.get(url + "/metrics", headers={"Authorization": "Bearer key-a"}, timeout=5)
    assert_openai_error(response.status_code, response.content, 403, "metrics_key_required")  # two tenants' traffic


def test_public_metrics_opens_metrics_only():
    with serve_in_thread(make_app(api_keys=(("key-a", "tenant-a"),), public_metrics=True)) as (url, _):
        assert httpx.get(url + "/metrics", timeout=5).status_code == 200
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401


# -- streams ---------------------------------------------------------------------------------------
@contextmanager
def slow_server(delay, n_slots=1, send_buffer=None, **config):
    target = SlowFake(seed=7, n_ctx=16384)
    app = make_app(Engine(target, n_slots=n_slots), **config)
    with serve_in_thread(app) as (url, server):
        if send_buffer is not None:  # the connections it accepts inherit it (and lose autotuning)
            for listener in server.servers:
                for sock in listener.sockets:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        target.delay = delay
        yield url, app, server


def wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_stream_reader_that_stops_reading_is_cut_and_its_generation_cancelled():
    # Small socket buffers on both sides: the stream fills them (and uvicorn's 64 KiB) in a second.
    with slow_server(0.001, write_timeout=0.5, send_buffer=8192) as (url, app, server):
        scheduler = app.state.specdec.scheduler
        body = json.dumps(chat_body(max_tokens=15000, stream=True, ignore_eos=True,
                                    speculative_decoding=False)).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
        try:
            sock.connect(address(url))
            sock.sendall(request_head("POST", "/v1/chat/completions", ["Content-Type: application/json",
                                                                       f"Content-Length: {len(body)}"]) + body)
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
            assert wait_for(lambda: scheduler.num_running == 1, 10)
            # ...and never reads again: the stream is cut and its slot freed, long before 15000 tokens.
            assert wait_for(lambda: scheduler.num_running == 0, 20), "a stalled reader kept its generation running"
            assert scheduler.num_waiting == 0
            # The connection is aborted too, unread bytes and all: it no longer counts against
            # limit_concurrency (a plain close would wait for the client to read them).
            connections = server.server_state.connections
            assert wait_for(lambda: not connections, 5), "a stalled reader's connection stayed open"
            received = read_until_closed(sock, 5)
        finally:
            sock.close()
        assert b"data: [DONE]" not in received
        assert_healthy(url)


def test_an_answer_left_unread_below_the_pause_mark_does_not_hold_its_connection():
    """A reader that stops reading after its request: the answer (50 KB) fills the kernel's
    buffers (8 KiB each side) and leaves the rest in uvicorn's, below the 64 KiB at which writing
    pauses, so no write timer starts; the keep-alive close then waited for those bytes to be read,
    forever (the same with `Connection: close`). Now they get `write_timeout`, then the connection
    is aborted."""
    for close in (False, True):
        with slow_server(0.0, write_timeout=0.5, keep_alive_timeout=0.5, send_buffer=8192) as (url, app, server):
            _send_and_never_read(url, app, server, close)
            assert_healthy(url)


def _send_and_never_read(url, app, server, close: bool) -> None:
    body = json.dumps(chat_body(max_tokens=40, ignore_eos=True, speculative_decoding=False,
                                logprobs=True, top_logprobs=20)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    headers = ["Content-Type: application/json", f"Content-Length: {len(body)}", *(["Connection: close"] * close)]
    try:
        sock.connect(address(url))
        sock.sendall(request_head("POST", "/v1/chat/completions", headers) + body)
        scheduler = app.state.specdec.scheduler
        assert wait_for(lambda: scheduler.num_running == 0 and server.server_state.total_requests == 1, 10)
        connections = server.server_state.connections
        assert wait_for(lambda: not connections, 5), f"an unread answer's connection stayed open (close: {close})"
    finally:
        sock.close()


def test_a_queued_stream_gets_keepalive_comments():
    with slow_server(0.005, sse_keepalive=0.2) as (url, app, _):
        with httpx.Client(timeout=10) as first_client, httpx.Client(timeout=10) as second_client:
            long = chat_body(max_tokens=2000, stream=True, ignore_eos=True, speculative_decoding=False)
            with first_client.stream("POST", url + "/v1/chat/completions", json=long) as first:
                assert first.status_code == 200
                first_lines = first.iter_lines()  # kept: a collected iterator would close the stream
                next(first_lines)  # generating: the one slot is taken
                with second_client.stream("POST", url + "/v1/chat/completions", json=long) as second:
                    assert second.status_code == 200
                    lines = second.iter_lines()
                    assert next(lines) == ": keep-alive"  # still queued: nothing else to say yet
                    assert next(line for line in lines if line) == ": keep-alive"
                    assert app.state.specdec.scheduler.num_waiting == 1
        scheduler = app.state.specdec.scheduler
        assert wait_for(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0, 10)


# -- many connections ------------------------------------------------------------------------------
# The 200 clients run in a process of their own: sharing the test's interpreter, their own event
# loop delayed the health check's request past its deadline before the server ever saw it.
LOAD_CLIENTS = """
import asyncio, json, sys
import httpx

async def main(url, bodies):
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        async def one(body):
            return (await client.post("/v1/chat/completions", json=body)).status_code
        print("go", flush=True)
        return await asyncio.gather(*map(one, bodies))

print(json.dumps(asyncio.run(main(sys.argv[1], json.loads(sys.stdin.readline())))))
"""


def test_200_concurrent_requests_get_no_5xx_and_health_answers_within_a_second():
    app = make_app(Engine(FakeBackend(seed=7, n_ctx=N_CTX), n_slots=4), max_queue=32)
    scheduler = app.state.specdec.scheduler
    bodies = [chat_body(f"the cat {i}", max_tokens=8, stream=i % 2 == 0) for i in range(200)]
    with serve_in_thread(app) as (url, _):
        load = subprocess.Popen([sys.executable, "-c", LOAD_CLIENTS, url], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            load.stdin.write(json.dumps(bodies) + "\n")
            load.stdin.flush()
            assert load.stdout.readline().strip() == "go"
            health, checked_while_busy = [], 0
            with httpx.Client(base_url=url, timeout=1.0) as health_client:
                while load.poll() is None:
                    time.sleep(0.02)  # often: the whole load can be over within a tenth of a second
                    busy = scheduler.num_running + scheduler.num_waiting > 0
                    health.append(health_client.get("/health").status_code)  # within 1 s, or raises
                    checked_while_busy += busy
            statuses = json.loads(load.communicate(timeout=30)[0])
        finally:
            load.kill()
        assert load.returncode == 0
        assert set(health) == {200}
        assert checked_while_busy >= 1, "no health check overlapped the load"
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        assert statuses.count(200) >= 36  # at least the slots and the queue's worth
        assert_healthy(url)


def test_connections_over_limit_concurrency_get_503():
    with serve_in_thread(make_app(limit_concurrency=4, header_timeout=30.0)) as (url, _):
        idle = [socket.create_connection(address(url), timeout=5) for _ in range(4)]
        try:
            time.sleep(0.2)
            response = httpx.get(url + "/v1/models", timeout=5)
            assert response.status_code == 503 and response.json()["error"]["code"] == "too_many_connections"
            assert httpx.get(url + "/health", timeout=5).status_code == 200  # the orchestrator's probe, always
        finally:
            for sock in idle:
                sock.close()
        assert wait_for(lambda: httpx.get(url + "/v1/models", timeout=5).status_code == 200, 5)


# -- one token per chunk ---------------------------------------------------------------------------
def test_token_pieces_cut_at_token_ends_and_never_inside_a_character():
    pieces = {10: b"the ", 11: b"\xc3", 12: b"\xa9", 13: b"!", 14: b"ab", 15: b"c"}
    splitter = TokenPieces(pieces.__getitem__)
    assert splitter.split("the \u00e9!", [10, 11, 12, 13]) == ["the ", "\u00e9", "!"]
    assert splitter.split("", [11]) == []  # half a character: nothing yet
    assert splitter.split("\u00e9a", [12, 14]) == ["\u00e9", "a"]  # "b" held back (a stop string's start?)
    assert splitter.split("bc", [15]) == ["b", "c"]
    assert splitter.split("\ufffd", [11]) == ["\ufffd"]  # the end: a broken last character, flushed


MIXED = ["the cat sat on the mat", "abc abc abc abc", "caf\u00e9 caf\u00e9 caf\u00e9", "on the mat on the"]


def draft_engine():
    return Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=2)


def reference(prompt, max_tokens):
    engine = Engine(FakeBackend(seed=7))
    request = GenerationRequest(tuple(engine.encode_prompt(prompt, chat=True)), max_tokens, SamplingParams(),
                                SpecConfig("off", 0))
    return engine.generate(request)


def token_texts(token_ids):
    """Each token's text as the engine decodes it; tokens ending inside a character give none."""
    decoder, backend = codecs.getincrementaldecoder("utf-8")(errors="replace"), FakeBackend()
    texts = [decoder.decode(backend.token_bytes(t)) for t in token_ids] + [decoder.decode(b"", final=True)]
    return [t for t in texts if t]


def streamed_contents(url, prompt, method, max_tokens=60, **fields):
    body = chat_body(prompt, max_tokens=max_tokens, stream=True,
                     speculative_decoding={"method": method, "num_speculative_tokens": 4}, **fields)
    contents = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    contents.append(chunk["choices"][0]["delta"]["content"])
    return contents


@pytest.fixture(scope="module")
def per_token():
    with serve_in_thread(create_app(draft_engine(), ServerConfig(served_model_name=MODEL))) as (url, _):
        yield url


@pytest.mark.parametrize("method", ["off", "ngram", "draft", "auto"])
def test_one_token_per_chunk_and_the_same_text(per_token, method):
    accepted = 0
    for prompt in MIXED:
        expected = reference(prompt, 60)
        contents = streamed_contents(per_token, prompt, method)
        assert "".join(contents) == expected.text
        assert contents == token_texts(expected.token_ids)  # chunk i is token i's text: at most one token each
        response = httpx.post(per_token + "/v1/chat/completions", timeout=30, json=chat_body(
            prompt, max_tokens=60, speculative_decoding={"method": method, "num_speculative_tokens": 4})).json()
        assert response["choices"][0]["message"]["content"] == expected.text
        accepted += response["usage"]["speculative"]["accepted_tokens"]
    if method == "draft":
        assert accepted > 0  # steps of several tokens were split


def test_one_token_per_chunk_with_a_stop_string(per_token):
    full = reference("the cat sat on the mat", 60).text
    stop = full[10:13]
    contents = streamed_contents(per_token, "the cat sat on the mat", "draft", stop=[stop])
    assert "".join(contents) == full[: full.index(stop)]
    assert all(len(c) <= max(len(p.decode("utf-8", "replace")) for p in FakeBackend().pieces) for c in contents)


def test_coalesced_chunks_carry_a_step_each():
    config = ServerConfig(served_model_name=MODEL, stream_one_token_per_chunk=False)
    with serve_in_thread(create_app(draft_engine(), config)) as (url, _):
        expected = reference("abc abc abc abc", 60)
        contents = streamed_contents(url, "abc abc abc abc", "draft")
        assert "".join(contents) == expected.text
        assert len(contents) < len(token_texts(expected.token_ids))  # accepted drafts share their step's chunk
