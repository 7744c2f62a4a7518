"""Log-probabilities (chat `logprobs`/`top_logprobs`, completions `logprobs`/`echo`) and `n` > 1,
through the official `openai` client against a live loopback server on fake backends; and the
log-probability math alone (sampling/logprobs.py)."""
import numpy as np
import openai
import pytest
from fakes.threads import wait_until

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.sampling.logprobs import MIN_LOGPROB, log_softmax, token_logprob
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-target"
METHODS = ["off", "ngram", "draft", "auto"]


# -- the math ------------------------------------------------------------------------------------
def test_log_softmax_is_the_normalised_log_distribution():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    expected = np.log(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum())
    assert np.allclose(log_softmax(logits), expected, atol=1e-12)
    assert np.isclose(np.exp(log_softmax(np.array([1e4, 1e4 - 1], dtype=np.float32))).sum(), 1.0)  # no overflow


def test_token_logprob_lists_the_top_most_likely_first_ties_by_id():
    logits = np.array([1.0, 3.0, 3.0, 0.0, 2.0], dtype=np.float32)
    entry = token_logprob(logits, 4, top=3)
    lp = log_softmax(logits)
    assert entry.token_id == 4 and entry.logprob == pytest.approx(lp[4])
    assert [t for t, _ in entry.top] == [1, 2, 4]
    assert [v for _, v in entry.top] == pytest.approx([lp[1], lp[2], lp[4]])
    assert token_logprob(logits, 0, top=0).top == ()
    assert [t for t, _ in token_logprob(logits, 0, top=50).top] == [1, 2, 4, 0, 3]  # top beyond the vocabulary


def test_a_token_without_mass_reports_openais_floor_not_minus_infinity():
    logits = np.array([0.0, -np.inf, 1.0], dtype=np.float32)
    entry = token_logprob(logits, 1, top=3)
    assert entry.logprob == MIN_LOGPROB
    assert entry.top[-1] == (1, MIN_LOGPROB)


# -- the server ----------------------------------------------------------------------------------
def make_engine(n_slots=8):
    return Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=n_slots)


def serve(n_slots=8, **config):
    config.setdefault("spec", SpecConfig("draft", 4))
    return serve_in_thread(create_app(make_engine(n_slots), ServerConfig(served_model_name=MODEL, **config)))


@pytest.fixture(scope="module")
def server():
    with serve() as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


def chat(client, prompt, method="draft", **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}],
        extra_body={"speculative_decoding": {"method": method, "num_speculative_tokens": 4}}, **kw)


def fake_logprobs(prompt_ids, token_ids):
    """Each token's log-probability under the fake target, straight from its logits rows."""
    rows = FakeBackend(seed=7).eval(0, 0, list(prompt_ids) + list(token_ids)).astype(np.float64)
    out = []
    for i, token in enumerate(token_ids):
        row = rows[len(prompt_ids) - 1 + i]
        out.append(row[token] - (row.max() + np.log(np.exp(row - row.max()).sum())))
    return out


def reference(prompt, max_tokens):
    """The prompt's ids and the token ids the engine alone generates for it (greedy, plain decoding)."""
    engine = make_engine(1)
    ids = engine.encode_prompt(prompt, chat=False)
    return ids, engine.generate(GenerationRequest(tuple(ids), max_tokens, SamplingParams(), SpecConfig("off", 0))).token_ids


def token_ids(texts):
    """The fake's ids of tokens given as bytes (its vocabulary maps each piece to one id)."""
    backend = FakeBackend(seed=7)
    by_piece = {piece: i for i, piece in enumerate(backend.pieces)}
    return [by_piece[bytes(data)] for data in texts]


def test_chat_logprobs_are_the_targets_and_spell_the_text(client):
    prompt = "the cat sat on the mat"
    response = chat(client, prompt, max_tokens=40, logprobs=True, top_logprobs=5)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == choice.message.content
    assert all(t.token == bytes(t.bytes).decode("utf-8", "replace") for t in content)
    for entry in content:
        assert len(entry.top_logprobs) == 5
        tops = [top.logprob for top in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one, listed first.
        assert entry.logprob == tops[0] == max(tops) and entry.top_logprobs[0].token == entry.token
    prompt_ids = make_engine(1).encode_prompt(prompt, chat=True)
    expected = fake_logprobs(prompt_ids, token_ids(t.bytes for t in content))
    assert [t.logprob for t in content] == pytest.approx(expected, abs=1e-9)


def test_streamed_chat_logprobs_go_with_their_chunks(client):
    whole = chat(client, "abc abc abc", max_tokens=40, logprobs=True, top_logprobs=2).choices[0]
    chunks = list(chat(client, "abc abc abc", max_tokens=40, logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in whole.logprobs.content]
    for c in chunks:  # a chunk's tokens spell its text (one token per chunk by default)
        if c.choices and c.choices[0].logprobs:
            assert "".join(t.token for t in c.choices[0].logprobs.content) == c.choices[0].delta.content


def test_without_logprobs_none_are_sent(client):
    response = chat(client, "abc", max_tokens=10)
    assert response.choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in chat(client, "abc", max_tokens=10, stream=True) if c.choices)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_logprobs_are_identical_under_every_method(client, temperature):
    def content(method):
        response = chat(client, "on the mat on the", method=method, max_tokens=40, temperature=temperature,
                        seed=11, logprobs=True, top_logprobs=3)
        return response.choices[0].message.content, [t.model_dump() for t in response.choices[0].logprobs.content]

    results = {method: content(method) for method in METHODS}
    if temperature == 0:
        assert all(result == results["off"] for result in results.values())
        return
    # Sampled: a draft model's rounds draw differently (docs/exactness.md), so compare up to where
    # the texts part: the distribution at a position never depends on who proposed its token.
    assert results["ngram"] == results["off"]
    off = results["off"][1]
    for method in ("draft", "auto"):
        values = results[method][1]
        shared = next((i for i, (a, b) in enumerate(zip(values, off)) if a["token"] != b["token"]),
                      min(len(values), len(off)))
        assert values[:shared] == off[:shared]
        if shared < min(len(values), len(off)):  # the first token that differs: drawn from the same distribution
            assert values[shared]["top_logprobs"] == off[shared]["top_logprobs"]


def test_completion_logprobs_legacy_shape(client):
    response = client.completions.create(model=MODEL, prompt="the cat", max_tokens=30, temperature=0, logprobs=3)
    choice = response.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == logprob == max(top.values())  # the chosen token is listed
    prompt_ids, generated = reference("the cat", 30)
    assert lp.token_logprobs == pytest.approx(fake_logprobs(prompt_ids, generated), abs=1e-9)


def test_streamed_completion_logprobs_equal_the_whole(client):
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=25, temperature=0, logprobs=1)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=25, temperature=0, logprobs=1,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.choices[0].logprobs.tokens
    assert [v for p in parts for v in p.token_logprobs] == whole.choices[0].logprobs.token_logprobs
    assert [o for p in parts for o in p.text_offset] == whole.choices[0].logprobs.text_offset


def test_echo_returns_the_prompt_and_its_logprobs_first_null(client):
    prompt = "the cat sat"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, echo=True,
                                       logprobs=2)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text  # scoring the prompt leaves the answer as it was
    prompt_ids = make_engine(1).encode_prompt(prompt, chat=False)
    lp = choice.logprobs
    assert "".join(lp.tokens[:len(prompt_ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx(fake_logprobs(prompt_ids[:1], prompt_ids[1:]),
                                                                 abs=1e-9)
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])
    assert lp.text_offset[len(prompt_ids)] == len(prompt)
    assert echoed.usage.prompt_tokens == len(prompt_ids)

    bare = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, echo=True)
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None


def test_streamed_echo_sends_the_prompt_first(client):
    chunks = list(client.completions.create(model=MODEL, prompt="on the", max_tokens=15, temperature=0, echo=True,
                                            logprobs=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == "on the"
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) > 1
    whole = client.completions.create(model=MODEL, prompt="on the", max_tokens=15, temperature=0, echo=True,
                                      logprobs=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_n_greedy_gives_identical_choices(client):
    single = chat(client, "the cat", max_tokens=30)
    response = chat(client, "the cat", max_tokens=30, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert {c.message.content for c in response.choices} == {single.choices[0].message.content}
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert response.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_n_sampled_with_a_seed_is_reproducible_and_the_choices_differ(client):
    def texts(**kw):
        response = client.completions.create(model=MODEL, prompt="the", max_tokens=30, temperature=1.0, seed=5,
                                             extra_body={"ignore_eos": True}, **kw)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = texts(n=3)
    assert first == texts(n=3)
    assert len(set(first)) > 1
    assert first[0] == texts()[0]  # choice 0 uses the request's own seed


def test_n_streaming_sends_each_choice_with_its_index(client):
    whole = client.completions.create(model=MODEL, prompt="mat cat", max_tokens=20, temperature=0.7, seed=2, n=3,
                                      logprobs=1)
    chunks = list(client.completions.create(model=MODEL, prompt="mat cat", max_tokens=20, temperature=0.7, seed=2,
                                            n=3, logprobs=1, stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == choice.logprobs.tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_chat_streaming_opens_every_choice(client):
    chunks = list(chat(client, "x", max_tokens=10, n=2, stream=True))
    roles = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant")
    assert roles == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)]
    assert texts[0] == texts[1] == chat(client, "x", max_tokens=10).choices[0].message.content


@pytest.mark.parametrize("create, fields, param", [
    ("chat", {"n": 9}, "n"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("completions", {"n": 9}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
])
def test_out_of_range_values_are_400s_naming_the_field(client, create, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        if create == "chat":
            chat(client, "x", max_tokens=5, **fields)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=5, **fields)
    assert info.value.param == param and info.value.code == "invalid_value"


def test_the_queue_bound_counts_every_choice():
    with serve(n_slots=1, max_queue=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert len(client.completions.create(model=MODEL, prompt="x", max_tokens=5, n=3).choices) == 3  # 1 slot + 2 queued
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=5, n=4)


class FailingPromptBackend(FakeBackend):
    """Fails prompt processing on one sequence: the choice in that slot fails, the others not."""

    def eval(self, seq_id, start, tokens, *, prefill=False):
        if prefill and seq_id == 1:
            raise RuntimeError("injected failure")
        return super().eval(seq_id, start, tokens, prefill=prefill)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_choice_fails_the_request(stream):
    app = create_app(Engine(FailingPromptBackend(seed=7), n_slots=2),
                     ServerConfig(served_model_name=MODEL, spec=SpecConfig("off", 0)))
    with serve_in_thread(app) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="the cat", max_tokens=500, n=2, stream=stream,
                                      extra_body={"ignore_eos": True})
        assert info.value.code == "internal_error"
        scheduler = app.state.specdec.scheduler
        wait_until(lambda: scheduler.num_running == scheduler.num_waiting == 0)  # the other choice was cancelled
