"""llama-server's utility endpoints (server/llama_server_api.py) on a fake backend that tokenizes
as llama.cpp does where these routes show it (a BOS with add_special, control tokens that render
as nothing in token_bytes): /tokenize's defaults, pieces and mixed content, /detokenize's special
text and bad ids, /apply-template equal to what the chat route tokenizes, /props equal to the
engine's values, the size limit, unknown fields ignored and wrong types refused."""
import threading
from types import SimpleNamespace

import httpx
import pytest

import specdec
from specdec.backends.fake import SPECIAL_PIECES, FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.llama_server_api import props, router
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-llama"
N_CTX, SLOTS, MAX_TOKENS, MAX_PROMPT_BYTES = 1536, 3, 77, 4000
SPECIAL = b"<|special|>"  # an extra special piece: it honours parse_special (FakeBackend)
CONTROL = frozenset([*SPECIAL_PIECES, SPECIAL])
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class LlamaLikeBackend(FakeBackend):
    """add_special puts a BOS first; control tokens are nothing in token_bytes and their text in
    fingerprint_bytes, as llama.cpp's token_to_piece gives them without and with `special`. Records
    the thread of every tokenize call."""

    BOS = 0  # <|endoftext|>

    def __init__(self, **kw):
        super().__init__(seed=7, n_ctx=N_CTX, extra_special_pieces=[SPECIAL], chat_template=TEMPLATE, **kw)
        self.tokenize_threads: list[str] = []

    def tokenize(self, text, *, add_special=True, parse_special=True):
        self.tokenize_threads.append(threading.current_thread().name)
        ids = super().tokenize(text, add_special=add_special, parse_special=parse_special)
        return [self.BOS, *ids] if add_special else ids

    def token_bytes(self, token_id):
        return b"" if self.pieces[token_id] in CONTROL else self.pieces[token_id]

    def fingerprint_bytes(self, token_id):
        return self.pieces[token_id]


def make_engine():
    return Engine(LlamaLikeBackend(), n_slots=SLOTS)


def make_app(engine=None, **config):
    config = ServerConfig(served_model_name=MODEL, max_tokens=MAX_TOKENS, spec=SpecConfig("ngram", 5),
                          max_prompt_bytes=MAX_PROMPT_BYTES, **config)
    app = create_app(engine or make_engine(), config)
    app.include_router(router)
    return app


@pytest.fixture(scope="module")
def server():
    app = make_app()
    with serve_in_thread(app) as (url, _):
        yield url, app.state.specdec.engine


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def backend():
    """A backend like the server's, to compute expected ids in the test."""
    return LlamaLikeBackend()


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=30, **kw)


def ids_of(backend, text, parse_special=True):
    return backend.tokenize(text, add_special=False, parse_special=parse_special)


def piece_id(backend, piece: bytes) -> int:
    return backend.pieces.index(piece)


def assert_400(response, param=None, code=None):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# -- /tokenize ------------------------------------------------------------------------------------
def test_tokenize_defaults_parse_special_text_and_add_no_bos(url, backend):
    content = "<|special|>the cat"
    tokens = post(url, "/tokenize", {"content": content}).json()["tokens"]
    assert tokens[0] == piece_id(backend, SPECIAL)  # parse_special defaults to true
    assert tokens[0] != LlamaLikeBackend.BOS  # add_special defaults to false
    assert tokens == ids_of(backend, content)


def test_tokenize_add_special_and_parse_special_are_passed_on(url, backend):
    content = "<|special|>the cat"
    with_bos = post(url, "/tokenize", {"content": content, "add_special": True}).json()["tokens"]
    assert with_bos == [LlamaLikeBackend.BOS, *ids_of(backend, content)]
    plain = post(url, "/tokenize", {"content": content, "parse_special": False}).json()["tokens"]
    assert plain == ids_of(backend, content, parse_special=False)
    assert piece_id(backend, SPECIAL) not in plain and len(plain) > len(with_bos)


def test_tokenize_with_pieces_gives_bytes_for_a_split_character_and_special_text(url, backend):
    response = post(url, "/tokenize", {"content": "é!<|im_start|>", "with_pieces": True})
    assert response.json() == {"tokens": [
        {"id": piece_id(backend, b"\xc3"), "piece": [0xC3]},  # 'é' is split over two tokens
        {"id": piece_id(backend, b"\xa9"), "piece": [0xA9]},
        {"id": piece_id(backend, b"!"), "piece": "!"},
        {"id": piece_id(backend, b"<|im_start|>"), "piece": "<|im_start|>"},  # token_bytes would give ""
    ]}


def test_tokenize_mixed_content_takes_ids_and_adds_bos_only_before_a_first_string(url, backend):
    body = {"content": ["the ", 5, "cat"], "add_special": True}
    assert post(url, "/tokenize", body).json()["tokens"] == [
        LlamaLikeBackend.BOS, *ids_of(backend, "the "), 5, *ids_of(backend, "cat")]
    body = {"content": [5, "cat"], "add_special": True}
    assert post(url, "/tokenize", body).json()["tokens"] == [5, *ids_of(backend, "cat")]


def test_tokenize_without_content_gives_no_tokens(url):
    assert post(url, "/tokenize", {}).json() == {"tokens": []}


def test_tokenize_ignores_unknown_fields(url, backend):
    response = post(url, "/tokenize", {"content": "the cat", "model": "anything", "extra": {"a": [1]}})
    assert response.status_code == 200 and response.json()["tokens"] == ids_of(backend, "the cat")


@pytest.mark.parametrize("body, param", [
    ({"content": 5}, "content"),
    ({"content": "x", "add_special": "true"}, "add_special"),
    ({"content": "x", "with_pieces": 1}, "with_pieces"),
    ({"content": "x", "parse_special": "no"}, "parse_special"),
    ({"content": ["x", True]}, None),
])
def test_tokenize_wrong_types_are_400s(url, body, param):
    error = assert_400(post(url, "/tokenize", body))
    if param is not None:
        assert error["param"] == param


def test_tokenize_content_over_the_byte_limit_is_refused_before_tokenizing(server):
    url, engine = server
    # 2,001 characters of two bytes each: over the limit in bytes, not in characters.
    engine.target.tokenize_threads.clear()
    assert_400(post(url, "/tokenize", {"content": "é" * (MAX_PROMPT_BYTES // 2 + 1)}), "content",
               "context_length_exceeded")
    assert engine.target.tokenize_threads == []
    ok = post(url, "/tokenize", {"content": "é" * (MAX_PROMPT_BYTES // 2)})
    assert ok.status_code == 200 and len(ok.json()["tokens"]) == MAX_PROMPT_BYTES


def test_tokenize_runs_off_the_event_loop(server):
    url, engine = server
    engine.target.tokenize_threads.clear()
    assert post(url, "/tokenize", {"content": "the cat"}).status_code == 200
    assert engine.target.tokenize_threads, "the route did not tokenize with the engine's target"
    loop_thread = {t.name for t in threading.enumerate() if t.name.startswith("uvicorn-")}
    assert not set(engine.target.tokenize_threads) & loop_thread


def test_tokenize_id_outside_the_vocabulary_is_a_400(url, backend):
    assert_400(post(url, "/tokenize", {"content": ["x", backend.vocab_size], "with_pieces": True}),
               "content[1]", "invalid_token_id")


# -- /detokenize ----------------------------------------------------------------------------------
def test_tokenize_detokenize_round_trip_keeps_special_text(url):
    text = "the cat sat on the mat, café <|special|><|im_end|>!"
    tokens = post(url, "/tokenize", {"content": text}).json()["tokens"]
    assert post(url, "/detokenize", {"tokens": tokens}).json() == {"content": text}


def test_detokenize_renders_special_tokens_as_text_and_broken_bytes_as_replacement(url, backend):
    tokens = [piece_id(backend, b"<|im_start|>"), piece_id(backend, b"\xc3"), piece_id(backend, b"!")]
    assert post(url, "/detokenize", {"tokens": tokens}).json() == {"content": "<|im_start|>\ufffd!"}
    assert post(url, "/detokenize", {}).json() == {"content": ""}


@pytest.mark.parametrize("bad", ["vocab", -1, 2**40])
def test_detokenize_id_outside_the_vocabulary_is_a_400(url, backend, bad):
    token = backend.vocab_size if bad == "vocab" else bad
    error = assert_400(post(url, "/detokenize", {"tokens": [5, token]}), "tokens[1]", "invalid_token_id")
    assert str(token) in error["message"]
    ok = post(url, "/detokenize", {"tokens": [5, backend.vocab_size - 1]})
    assert ok.status_code == 200


@pytest.mark.parametrize("body", [{"tokens": ["a"]}, {"tokens": 3}, {"tokens": [1.5]}, {"tokens": [True]}])
def test_detokenize_wrong_types_are_400s(url, body):
    assert_400(post(url, "/detokenize", body))


# -- /apply-template ------------------------------------------------------------------------------
MESSAGES = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "the cat sat on the mat"}]
TEMPLATE_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat on the mat"}]


def test_apply_template_renders_the_chat_with_the_generation_prompt(url):
    response = post(url, "/apply-template", {"messages": MESSAGES, "temperature": 0.3, "stream": True})
    assert response.json() == {"prompt": "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
                                         "the cat sat on the mat<|im_end|>\n<|im_start|>assistant\n"}


def test_apply_template_prompt_tokenizes_to_the_engines_chat_prompt(url):
    prompt = post(url, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    tokens = post(url, "/tokenize", {"content": prompt}).json()["tokens"]
    assert tokens == make_engine().encode_prompt(TEMPLATE_MESSAGES, chat=True)
    # ... and the chat route's own prompt is that long.
    chat = post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1,
                                              "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)


def test_apply_template_with_tools_renders_them_and_tool_choice_none_does_not(url):
    prompt = post(url, "/apply-template", {"messages": MESSAGES, "tools": [WEATHER]}).json()["prompt"]
    assert '"name": "get_weather"' in prompt and prompt.startswith("<|im_start|>system\n<tools>\n")
    tokens = post(url, "/tokenize", {"content": prompt}).json()["tokens"]
    assert tokens == make_engine().encode_prompt(TEMPLATE_MESSAGES, chat=True, tools=[WEATHER])
    without = post(url, "/apply-template", {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none"})
    assert "get_weather" not in without.json()["prompt"]


@pytest.mark.parametrize("body, param", [
    ({}, None),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
])
def test_apply_template_bad_requests_are_400s(url, body, param):
    error = assert_400(post(url, "/apply-template", body))
    if param is not None:
        assert error["param"] == param


def test_apply_template_over_the_byte_limit_is_a_400(url):
    body = {"messages": [{"role": "user", "content": "é" * (MAX_PROMPT_BYTES // 2 + 1)}]}
    assert_400(post(url, "/apply-template", body), "messages", "context_length_exceeded")
    body = {"messages": [{"role": "user", "content": "é" * (MAX_PROMPT_BYTES // 2)}]}
    assert post(url, "/apply-template", body).status_code == 200


# -- /props ---------------------------------------------------------------------------------------
def test_props_are_the_engines_and_the_servers_values(server):
    url, engine = server
    data = httpx.get(url + "/props", timeout=30).json()
    settings = data["default_generation_settings"]
    assert settings["n_ctx"] == engine.target.n_ctx == N_CTX
    assert data["total_slots"] == len(engine.slots) == SLOTS
    assert data["model_alias"] == MODEL
    assert data["chat_template"] == TEMPLATE
    assert data["modalities"] == {"vision": False, "audio": False}
    assert data["build_info"] == f"specdec-{specdec.__version__}"
    assert "model_path" not in data  # a fake backend has no file
    params = settings["params"]
    assert params["n_predict"] == params["max_tokens"] == MAX_TOKENS
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (1.0, 0, 1.0, 0.0)
    assert params["speculative_decoding"] == {"method": "ngram", "num_speculative_tokens": 5}


def test_props_default_temperature_is_what_a_chat_without_one_samples_at(server):
    url, _ = server
    params = httpx.get(url + "/props", timeout=30).json()["default_generation_settings"]["params"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "seed": 3}
    unset = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    explicit = post(url, "/v1/chat/completions", {**body, "temperature": params["temperature"],
                                                  "top_p": params["top_p"]}).json()
    assert explicit["choices"][0]["message"]["content"] == unset


def test_props_name_the_model_file_and_omit_a_template_there_is_none_of():
    engine = Engine(FakeBackend(seed=7), n_slots=1)
    state = SimpleNamespace(engine=engine, config=ServerConfig(served_model_name="m"))
    assert "chat_template" not in props(state) and "model_path" not in props(state)
    engine.target.model_path = "/models/target.gguf"
    engine.target.chat_template = TEMPLATE
    data = props(state)
    assert data["model_path"] == "/models/target.gguf" and data["chat_template"] == TEMPLATE
    assert data["total_slots"] == 1 and data["default_generation_settings"]["n_ctx"] == 2048


# -- the app --------------------------------------------------------------------------------------
def test_the_routes_are_not_in_the_openapi_document(url):
    paths = httpx.get(url + "/openapi.json", timeout=30).json()["paths"]
    assert "/v1/chat/completions" in paths
    assert not {"/tokenize", "/detokenize", "/apply-template", "/props"} & set(paths)


def test_the_routes_need_the_key_when_keys_are_set():
    app = make_app(Engine(LlamaLikeBackend(), n_slots=1), api_key="sk-test")
    with serve_in_thread(app) as (url, _):
        assert httpx.get(url + "/props", timeout=30).status_code == 401
        assert post(url, "/tokenize", {"content": "x"}).status_code == 401
        ok = post(url, "/tokenize", {"content": "x"}, headers={"Authorization": "Bearer sk-test"})
        assert ok.status_code == 200
