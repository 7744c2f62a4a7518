"""Bad input gets an OpenAI-shaped 4xx naming the parameter, never a 500; auth; unknown routes."""
import httpx
import openai
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread

pytestmark = pytest.mark.timeout(60)

MODEL = "fake"
MSG = [{"role": "user", "content": "the cat"}]


def make_app(draft=True, n_ctx=256, **config):
    engine = Engine(FakeBackend(seed=7, n_ctx=n_ctx), FakeBackend(seed=7, noise=0.6, n_ctx=n_ctx) if draft else None,
                    n_slots=2)
    return create_app(engine, ServerConfig(served_model_name=MODEL, **config))


@pytest.fixture(scope="module")
def url():
    with serve_in_thread(make_app()) as (base, _):
        yield base


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def chat(url, **fields):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def completion(url, **fields):
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 4, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_malformed_json_and_non_object_bodies(url):
    for content in [b"{", b"[]", b"42", b"null", b"\xff\xfe", b""]:
        r = httpx.post(url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert_error(r, 400)


@pytest.mark.parametrize("fields, param", [
    ({"model": None}, "model"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 7}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"n": 9}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"speculative_decoding": {"method": "medusa"}}, "speculative_decoding.method"),
    ({"speculative_decoding": {"num_speculative_tokens": 99}}, "speculative_decoding.num_speculative_tokens"),
    ({"speculative_decoding": "yes please"}, "speculative_decoding"),
])
def test_invalid_fields_name_the_parameter(url, fields, param):
    assert_error(chat(url, **fields), 400, param)


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 0.5), ("presence_penalty", -1),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"), ("store", True), ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high"), ("service_tier", "flex"),
    ("web_search_options", {}),
])
def test_unimplemented_openai_fields_are_refused_unless_neutral(url, field, value):
    error = assert_error(chat(url, **{field: value}), 400, field)
    assert "not supported" in error["message"]


def test_neutral_values_are_accepted(url):
    r = chat(url, logprobs=False, top_logprobs=0, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
             tools=[], tool_choice="none", response_format={"type": "text"}, user="u1", store=False,
             metadata={"k": "v"}, n=1, service_tier="auto", parallel_tool_calls=True, modalities=["text"],
             max_completion_tokens=3, seed=-5, stop="zz", top_k=-1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("fields, param", [
    ({"prompt": [[]]}, "prompt[0]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 100000]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"suffix": "end"}, "suffix"),
    ({"n": 9}, "n"),
])
def test_completion_bad_input(url, fields, param):
    assert_error(completion(url, **fields), 400, param)


def test_lone_surrogate_is_400(url):
    for path, body in [("/v1/completions", b'{"model": "fake", "prompt": "a\\ud800"}'),
                       ("/v1/chat/completions", b'{"model": "fake", "messages": [{"role": "user", "content": "\\udfff"}]}')]:
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
        assert_error(r, 400, "prompt" if path == "/v1/completions" else "messages")


def test_completion_accepts_token_ids_and_a_one_string_list(url):
    assert completion(url, prompt=[5, 6, 7]).status_code == 200
    assert completion(url, prompt=["the cat"]).status_code == 200


def test_unknown_model_is_404(url):
    assert_error(chat(url, model="gpt-4o"), 404, "model", "model_not_found")
    assert_error(completion(url, model="gpt-4o"), 404, "model", "model_not_found")
    assert_error(httpx.get(url + "/v1/models/gpt-4o"), 404, "model")
    assert httpx.get(url + f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_context_limits_name_the_parameter(url):
    long = "the cat " * 200  # 400 tokens against a context of 256
    assert_error(chat(url, messages=[{"role": "user", "content": long}]), 400, "messages", "context_length_exceeded")
    assert_error(completion(url, prompt=long), 400, "prompt", "context_length_exceeded")



@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_beyond_the_context_is_clamped_to_the_room_left(url, field):
    """As peers do (agents ask for 32,000): the answer ends with "length" where the context is full."""
    r = chat(url, **{field: 250}, ignore_eos=True, temperature=0)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["total_tokens"] == 256  # the fake's context


def test_unknown_fields_are_ignored_at_every_level_and_named_in_a_header(url):
    r = chat(url, frobnicate=1, prompt_cache_key="thread-1", safety_identifier="u1",
             messages=[{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}],
             stream_options=None)
    assert r.status_code == 200, r.text
    named = r.headers["x-specdec-ignored-fields"].split(", ")
    assert named == ["frobnicate", "prompt_cache_key", "safety_identifier", "messages[].cache_control"] or \
        sorted(named) == sorted(["frobnicate", "prompt_cache_key", "safety_identifier", "messages[].cache_control"])
    assert "x-specdec-ignored-fields" not in chat(url).headers  # nothing ignored, no header
    # A field this server declares but cannot honour is still a 400 naming it.
    assert_error(chat(url, presence_penalty=0.5), 400, "presence_penalty")


def test_no_max_tokens_runs_to_the_context_limit(url):
    r = completion(url, max_tokens=None, prompt="the cat", ignore_eos=True, temperature=0)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert 250 <= usage["total_tokens"] <= 257


def test_unknown_route_and_method(url):
    assert_error(httpx.get(url + "/v2/nothing"), 404)
    assert_error(httpx.get(url + "/v1/chat/completions"), 405)


def test_server_stays_up_after_bad_input(url):
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert chat(url).status_code == 200


def test_draft_method_without_a_draft_model_is_400():
    with serve_in_thread(make_app(draft=False)) as (base, _):
        assert_error(chat(base, speculative_decoding={"method": "draft"}), 400, "speculative_decoding.method")
        assert chat(base, speculative_decoding={"method": "ngram"}).status_code == 200


def test_api_key():
    with serve_in_thread(make_app(api_key="s3cret")) as (base, _):
        error = assert_error(chat(base), 401, None, "invalid_api_key")
        assert "API key" in error["message"]
        bad = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                         headers={"Authorization": "Bearer wrong"})
        assert_error(bad, 401)
        assert bad.headers["www-authenticate"] == "Bearer"
        for path in ["/v1/models", "/metrics", "/openapi.json"]:
            assert_error(httpx.get(base + path), 401)
        assert httpx.get(base + "/health").status_code == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3).choices[0].message.role == "assistant"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()


def test_ignored_field_names_cannot_break_or_inject_headers(url):
    r = chat(url, **{"x\U0004f9c4": 1, "a\r\nSet-Cookie: b": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-specdec-ignored-fields"] == "x%F1%8F%A7%84, a%0D%0ASet-Cookie%3A%20b"
    assert "set-cookie" not in r.headers
