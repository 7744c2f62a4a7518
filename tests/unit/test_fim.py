"""Fill-in-the-middle on fake backends whose vocabulary has Qwen's FIM tokens: the FIM prompt
keeps the user's text plain, `/v1/completions` with a suffix and llama-server's `/infill` answer
what the engine alone generates from that prompt, FIM's end tokens end the answer, and a model
without FIM tokens, or a field this server cannot honour, is a 400 naming the field."""
import json

import httpx
import openai
import pytest
from fakes.clock import FakeClock

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.fim import InfillLimits, InfillRequest, encode_fim, encode_infill, fim_tokens
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-coder"
FIM_PIECES = [b"<|fim_prefix|>", b"<|fim_suffix|>", b"<|fim_middle|>", b"<|fim_pad|>", b"<|repo_name|>",
              b"<|file_sep|>"]
PREFIX, SUFFIX = "def f(x):\n    the cat ", "\n    return x\n"
GREEDY = {"temperature": 0}


def fim_backend(**kw):
    return FakeBackend(seed=7, extra_special_pieces=FIM_PIECES, **kw)


def fim_engine(n_slots=2, n_ctx=2048):
    return Engine(fim_backend(n_ctx=n_ctx), fim_backend(noise=0.6, n_ctx=n_ctx), n_slots=n_slots)


def reference(ids, max_tokens, sampling=SamplingParams()):
    """What the engine alone generates from a FIM prompt, ending at FIM's end tokens."""
    engine = fim_engine(1)
    request = GenerationRequest(tuple(ids), max_tokens, sampling, SpecConfig("off", 0),
                                stop_token_ids=fim_tokens(engine.target).ends)
    return engine.generate(request)


@pytest.fixture(scope="module")
def server():
    app = create_app(fim_engine(), ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4)))
    with serve_in_thread(app) as (url, _):
        yield url


@pytest.fixture(scope="module")
def plain_server():
    """A model without FIM tokens (the default fake vocabulary)."""
    engine = Engine(FakeBackend(seed=7), n_slots=1)
    with serve_in_thread(create_app(engine, ServerConfig(served_model_name=MODEL))) as (url, _):
        yield url


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=30, **kw)


# -- rendering -----------------------------------------------------------------------------------
def test_fim_tokens_are_found_by_their_text_and_default_ids_stay():
    backend = fim_backend()
    fim = fim_tokens(backend)
    default = FakeBackend().pieces
    assert backend.pieces[:len(default)] == default  # the extension only appends
    first = len(default)
    assert (fim.prefix, fim.suffix, fim.middle, fim.repository, fim.file_separator) == (
        first, first + 1, first + 2, first + 4, first + 5)
    assert fim.ends == {first + 3, first + 4, first + 5}
    assert fim_tokens(FakeBackend()) is None


def test_user_text_stays_plain_in_the_fim_prompt():
    backend = fim_backend()
    fim = fim_tokens(backend)
    prefix, suffix = "a<|fim_suffix|>b", "<|fim_middle|>c<|file_sep|>"
    ids = encode_fim(backend, prefix, suffix)
    plain = backend.tokenize(prefix, parse_special=False)
    assert ids == [fim.prefix, *plain, fim.suffix, *backend.tokenize(suffix, parse_special=False), fim.middle]
    specials = {fim.prefix, fim.suffix, fim.middle, *fim.ends}
    assert [t for t in ids if t in specials] == [fim.prefix, fim.suffix, fim.middle]
    assert backend.detokenize(plain) == prefix


def test_infill_renders_extra_chunks_as_llama_server_does():
    backend = fim_backend()
    fim = fim_tokens(backend)
    body = InfillRequest(input_prefix="x = ", input_suffix="\n", prompt="1 +",
                         input_extra=[{"filename": "a.py", "text": "y = 2\n"}, {"text": "z\n"}])

    def plain(text):
        return backend.tokenize(text, parse_special=False)

    expected = [fim.repository, *plain("myproject\n"), fim.file_separator, *plain("a.py\n"), *plain("y = 2\n"),
                fim.file_separator, *plain("tmp\n"), *plain("z\n"), fim.file_separator, *plain("filename\n"),
                fim.prefix, *plain("x = "), *plain("1 +"), fim.suffix, *plain("\n"), fim.middle]
    assert encode_infill(backend, body, 16) == expected


def test_infill_cuts_prefix_suffix_and_extra_to_its_window():
    backend = fim_backend(n_ctx=256)  # a window of 128 tokens: prefix 96, suffix 32 - 2 - prompt
    fim = fim_tokens(backend)
    body = InfillRequest(input_prefix="p" * 500 + "END", input_suffix="START" + "s" * 500,
                         input_extra=[{"filename": "old.py", "text": "o" * 500}, {"filename": "new.py", "text": "n"}])
    ids = encode_infill(backend, body, 16)
    start = ids.index(fim.prefix)
    prefix, suffix = ids[start + 1:ids.index(fim.suffix)], ids[ids.index(fim.suffix) + 1:-1]
    assert len(prefix) == 96 and backend.detokenize(prefix).endswith("END")
    assert len(suffix) == 30 and backend.detokenize(suffix).startswith("START")
    assert start == 256 - 128 - 2 * 16  # the extra chunks' newest tokens fill the rest
    assert backend.detokenize(ids[:start]).endswith("new.py\nn<|file_sep|>filename\n")


# -- ends ----------------------------------------------------------------------------------------
def test_fim_end_tokens_end_the_generation():
    """Sampled runs until one generates a FIM end token: with the FIM request's end tokens it
    stops right before it, as at the backend's own end-of-generation tokens."""
    engine = fim_engine(1)
    fim = fim_tokens(engine.target)
    ids = encode_fim(engine.target, PREFIX, SUFFIX)
    for seed in range(200):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        free = engine.generate(GenerationRequest(tuple(ids), 60, sampling, SpecConfig("off", 0)))
        hits = [i for i, t in enumerate(free.token_ids) if t in fim.ends]
        if hits:
            break
    else:
        pytest.fail("no seed generated a FIM end token")
    ended = reference(ids, 60, sampling)
    assert ended.token_ids == free.token_ids[:hits[0]] and ended.finish_reason == "stop"


# -- /v1/completions with a suffix ---------------------------------------------------------------
@pytest.mark.parametrize("method", ["off", "draft", "auto"])
def test_completion_with_suffix_is_the_engines_fim_answer(server, method):
    expected = reference(encode_fim(fim_backend(), PREFIX, SUFFIX), 40)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)
    response = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=40, temperature=0,
                                         extra_body={"speculative_decoding": {"method": method}})
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(encode_fim(fim_backend(), PREFIX, SUFFIX))


def test_empty_suffix_is_a_plain_completion(server):
    engine = fim_engine(1)
    expected = engine.generate(GenerationRequest(tuple(engine.encode_prompt(PREFIX, chat=False)), 20,
                                                 SamplingParams(), SpecConfig("off", 0)))
    body = {"model": MODEL, "prompt": PREFIX, "suffix": "", "max_tokens": 20, **GREEDY}
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == expected.text


def test_suffix_on_a_model_without_fim_tokens_is_a_400(plain_server):
    response = post(plain_server, "/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "b"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "suffix" and error["code"] == "fim_unsupported"


def test_suffix_with_echo_is_a_400(server):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "b", "echo": True})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "suffix" and error["code"] == "fim_unsupported"


def test_a_suffix_beside_token_ids_is_measured_before_it_is_tokenized(server, monkeypatch):
    tokenized = []
    monkeypatch.setattr(FakeBackend, "tokenize", lambda self, text, **kw: tokenized.append(len(text)) or [1])
    body = {"model": MODEL, "prompt": [1, 2, 3], "suffix": "x" * 2_000_000, "max_tokens": 4, **GREEDY}
    response = post(server, "/v1/completions", body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "suffix" and error["code"] == "context_length_exceeded"
    assert not [n for n in tokenized if n >= 2_000_000]


# -- /infill -------------------------------------------------------------------------------------
INFILL = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 40, **GREEDY}


def infill_reference(body, n_predict=40):
    backend = fim_backend()
    return reference(encode_infill(backend, InfillRequest(**body), n_predict), n_predict)


def test_infill_answers_llama_servers_shape(server):
    body = {**INFILL, "input_extra": [{"filename": "util.py", "text": "def g():\n    pass\n"}]}
    expected = infill_reference(body)
    response = post(server, "/infill", body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["content"] == expected.text and answer["stop"] is True and answer["model"] == MODEL
    assert answer["tokens_predicted"] == len(expected.token_ids)
    assert answer["tokens_evaluated"] == len(encode_infill(fim_backend(), InfillRequest(**body), 40))
    assert answer["stop_type"] == ("limit" if expected.finish_reason == "length" else "eos")
    timings = answer["timings"]
    assert timings["predicted_n"] == len(expected.token_ids) and timings["prompt_n"] > 0
    assert answer["generation_settings"]["samplers"] == ["temperature", "top_k", "top_p", "min_p"]


@pytest.mark.parametrize("method", ["off", "ngram", "draft", "auto"])
def test_infill_greedy_text_is_the_same_under_every_method(server, method):
    body = {**INFILL, "speculative_decoding": {"method": method, "num_speculative_tokens": 4}}
    assert post(server, "/infill", body).json()["content"] == infill_reference(INFILL).text


def test_infill_stream_is_llama_servers_events(server):
    expected = infill_reference(INFILL)
    response = post(server, "/infill", {**INFILL, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(block[len("data: "):]) for block in response.text.split("\n\n")
              if block.startswith("data: ")]
    assert "[DONE]" not in response.text  # llama-server ends an infill stream with its final object
    assert [event["stop"] for event in events] == [False] * (len(events) - 1) + [True]
    assert "".join(event["content"] for event in events) == expected.text
    assert events[-1]["content"] == "" and events[-1]["tokens_predicted"] == len(expected.token_ids)


def test_infill_response_fields_select_nested_values(server):
    answer = post(server, "/infill", {**INFILL, "response_fields": ["content", "timings/prompt_n", "nope/x"]}).json()
    assert set(answer) == {"content", "timings/prompt_n"} and answer["timings/prompt_n"] > 0


def test_infill_with_no_tokens_to_predict_warms_the_cache(server):
    """llama.vscode's preparation request: n_predict 0, the extra context processed, no text."""
    body = {"input_prefix": "", "input_suffix": "", "n_predict": 0, "samplers": [], "cache_prompt": True,
            "input_extra": [{"filename": "b.py", "text": "the cat sat on the mat\n"}], "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1}
    answer = post(server, "/infill", body).json()
    assert answer["content"] == "" and answer["tokens_predicted"] == 0 and answer["stop_type"] == "limit"


def test_llama_vscode_request_is_accepted(server):
    """llama.vscode's completion request as it sends it (src/llama-server.ts), `infill` sampler
    included (accepted, not applied)."""
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [], "prompt": "", "n_predict": 24,
            "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500, "t_max_predict_ms": 2500, "seed": 3}
    response = post(server, "/infill", body)
    assert response.status_code == 200, response.text
    settings = response.json()["generation_settings"]
    assert settings["samplers"] == ["top_k", "top_p"] and settings["temperature"] == 1.0  # no temperature sampler


@pytest.mark.parametrize("body, param", [
    ({"input_prefix": "a", "repeat_penalty": 1.1}, "repeat_penalty"),
    ({"input_prefix": "a", "samplers": ["top_k", "mirror"]}, "samplers"),
    ({"input_prefix": "a", "grammar": "root ::= \"x\""}, "grammar"),
    ({"input_prefix": "a", "input_extra": [{"filename": "a.py"}]}, "input_extra[0].text"),
])
def test_infill_refuses_what_it_cannot_honour(server, body, param):
    response = post(server, "/infill", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_infill_on_a_model_without_fim_tokens_is_a_400(plain_server):
    response = post(plain_server, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "fim_unsupported"


def test_infill_needs_a_key_when_keys_are_configured():
    config = ServerConfig(served_model_name=MODEL, api_key="sk-test")
    with serve_in_thread(create_app(fim_engine(1), config)) as (url, _):
        assert post(url, "/infill", INFILL).status_code == 401
        assert post(url, "/infill", INFILL, headers={"Authorization": "Bearer wrong"}).status_code == 401
        answer = post(url, "/infill", INFILL, headers={"Authorization": "Bearer sk-test"})
        assert answer.status_code == 200 and answer.json()["content"] == infill_reference(INFILL).text


# -- llama-server's cuts -------------------------------------------------------------------------
def test_n_indent_ends_the_answer_before_a_less_indented_line():
    limits = InfillLimits(n_indent=4, t_max_predict_ms=0, started=0.0)
    assert limits.feed("x = 1\n    y") == "x = 1\n    y"  # the first line is never checked
    assert limits.feed(" = 2\n  z = 3\n") == " = 2\n  " and limits.cut
    assert limits.feed("more") == ""


def test_t_max_predict_ms_ends_the_answer_once_a_line_is_done():
    clock = FakeClock()
    limits = InfillLimits(n_indent=0, t_max_predict_ms=100, started=clock(), clock=clock)
    clock.advance(1.0)
    assert limits.feed("no newline yet") == "no newline yet" and not limits.cut
    assert limits.feed(" done\n") == " done\n" and limits.cut


@pytest.mark.parametrize("stream", [False, True])
def test_infill_n_indent_cut_reaches_the_client(server, stream):
    """The answer is the engine's text up to the first later line indented less than n_indent
    (this suffix makes the fake write a line break early, then an unindented line)."""
    body = {**INFILL, "input_suffix": SUFFIX + "e"}
    full = infill_reference(body).text
    limits = InfillLimits(n_indent=1, t_max_predict_ms=0, started=0.0)
    kept = limits.feed(full)
    assert limits.cut and "\n" in kept and len(kept) < len(full)
    response = post(server, "/infill", {**body, "n_indent": 1, "stream": stream})
    if stream:
        events = [json.loads(block[len("data: "):]) for block in response.text.split("\n\n")
                  if block.startswith("data: ")]
        content, final = "".join(event["content"] for event in events), events[-1]
    else:
        final = response.json()
        content = final["content"]
    assert content == kept and final["stop_type"] == "limit"
