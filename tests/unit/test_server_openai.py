"""The official `openai` client against a live loopback server on fake backends: sync, async and
streaming; speculation on and off give the same greedy text; usage carries the speculative block;
8 simultaneous streams each equal their single-request text (continuous batching is exact)."""
import asyncio

import openai
import pytest
from fakes.clock import FakeClock

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-target"
PROMPTS = ["the cat sat on the mat", "abc abc abc", "hello wörld", "x", "the the the cat", "on the mat on the",
           "sat sat", "mat cat"]


def make_engine(n_slots=8):
    return Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=n_slots)


def reference_text(prompt, max_tokens, chat=True):
    """What the engine alone generates, greedy, with no speculation and no server."""
    engine = make_engine(1)
    ids = engine.encode_prompt(prompt, chat=chat)
    request = GenerationRequest(tuple(ids), max_tokens, SamplingParams(), SpecConfig("off", 0))
    return engine.generate(request)


@pytest.fixture(scope="module")
def server():
    app = create_app(make_engine(), ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4)))
    with serve_in_thread(app) as (url, uvicorn_server):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


def chat(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("method", ["off", "ngram", "draft", "auto"])
def test_sync_chat_greedy_equals_engine_alone(client, method):
    expected = reference_text("the cat sat on the mat", 40)
    response = chat(client, "the cat sat on the mat", max_tokens=40,
                    extra_body={"speculative_decoding": {"method": method, "num_speculative_tokens": 4}})
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.choices[0].message.role == "assistant"
    assert response.model == MODEL and response.object == "chat.completion"
    speculative = response.usage.model_extra["speculative"]
    assert speculative["method"] == method  # `auto` is the engine's adaptive method, not an alias


def test_speculative_object_without_method_uses_the_servers_method(client):
    response = chat(client, "the cat sat on the mat", max_tokens=20,
                    extra_body={"speculative_decoding": {"num_speculative_tokens": 2}})
    speculative = response.usage.model_extra["speculative"]
    assert speculative["method"] == "draft" and speculative["num_draft_tokens"] == 2


def test_speculation_on_and_off_same_text_and_usage_block(client):
    on = chat(client, "abc abc abc", max_tokens=50, extra_body={"speculative_decoding": True})
    off = chat(client, "abc abc abc", max_tokens=50, extra_body={"speculative_decoding": False})
    assert on.choices[0].message.content == off.choices[0].message.content
    usage = on.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]
    for key in ("method", "draft_rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "mean_acceptance_length", "accepted_per_position"):
        assert key in spec
    assert spec["method"] == "draft" and spec["drafted_tokens"] > 0
    assert spec["generated_tokens"] == usage.completion_tokens
    assert off.usage.model_extra["speculative"]["method"] == "off"
    assert off.usage.model_extra["speculative"]["drafted_tokens"] == 0


def test_text_completion_sync(client):
    expected = reference_text("the cat", 30, chat=False)
    response = client.completions.create(model=MODEL, prompt="the cat", max_tokens=30, temperature=0)
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_streaming_chat_with_usage(client):
    expected = reference_text("hello wörld", 40)
    stream = chat(client, "hello wörld", max_tokens=40, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert "speculative" in chunks[-1].usage.model_extra


def test_streaming_completion_without_usage(client):
    expected = reference_text("abc", 25, chat=False)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=25, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert all(c.usage is None for c in chunks)


def test_async_client(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=30)
        response = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=0, max_tokens=20)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=0, max_tokens=20, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        return response.choices[0].message.content, streamed

    text, streamed = asyncio.run(main())
    assert text == streamed == reference_text("x", 20).text


def test_eight_simultaneous_streams_equal_their_single_request_text(server):
    expected = {p: reference_text(p, 60).text for p in PROMPTS}

    async def one(client, prompt, method):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=60, stream=True,
            extra_body={"speculative_decoding": {"method": method}})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=30)
        methods = ["draft", "ngram", "off", "draft"] * 2
        texts = await asyncio.gather(*(one(client, p, m) for p, m in zip(PROMPTS, methods)))
        await client.close()
        return texts

    texts = asyncio.run(main())
    assert texts == [expected[p] for p in PROMPTS]


def test_batches_share_one_target_forward(server):
    """With 8 streams in flight, the worker verifies several sequences per eval_many call."""
    app = server[1]
    engine = app.state.specdec.engine
    calls = []
    original = engine.target.eval_many

    def spy(requests):
        calls.append(len(requests))
        return original(requests)

    engine.target.eval_many = spy
    try:
        async def main():
            client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=30)
            await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=80, temperature=0,
                                                             extra_body={"ignore_eos": True}) for p in PROMPTS))
            await client.close()

        asyncio.run(main())
    finally:
        del engine.target.eval_many
    assert max(calls) > 1


def test_sampling_with_seed_is_reproducible(client):
    a = chat(client, "the cat", max_tokens=30, temperature=0.9, seed=3, top_p=0.9, extra_body={"top_k": 20, "min_p": 0.01})
    b = chat(client, "the cat", max_tokens=30, temperature=0.9, seed=3, top_p=0.9, extra_body={"top_k": 20, "min_p": 0.01})
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("method", ["off", "draft"])
def test_stop_string_is_honoured(client, method):
    full = reference_text("the cat sat on the mat", 60).text
    stop = full[10:12]
    cut = full[: full.index(stop)]
    response = chat(client, "the cat sat on the mat", max_tokens=60, stop=[stop],
                    extra_body={"speculative_decoding": {"method": method, "num_speculative_tokens": 4}})
    assert response.choices[0].message.content == cut
    assert response.choices[0].finish_reason == "stop"


def history_server(**config):
    """A server on a fake with known forward costs, so that `auto` drafts from a history when one matches."""
    clock = FakeClock()
    engine = Engine(FakeBackend(seed=7, clock=clock, step_cost=0.05, token_cost=0.0005), clock=clock)
    return serve_in_thread(create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("auto", 4),
                                                           **config)))


def cache_choices(url, api_key="unused"):
    """Whether the request drafted from a cross-request history (`auto`'s "cache" choices)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=30)
    choices = chat(client, "mat cat", max_tokens=40).usage.model_extra["speculative"]["choices"]
    return any(choice.startswith("cache") for choice in choices)


def test_cross_request_history_is_kept_per_api_key():
    """A tenant's repeated request drafts from its own earlier answer; another tenant's never does."""
    with history_server(api_keys=(("key-a", "tenant-a"), ("key-b", "tenant-b"))) as (url, _):
        assert not cache_choices(url, "key-a")
        assert cache_choices(url, "key-a")
        assert not cache_choices(url, "key-b")


def test_anonymous_requests_share_no_history_unless_asked():
    """Without keys a bearer string proves nothing: no request drafts from another's text..."""
    with history_server() as (url, _):
        assert not cache_choices(url, "tenant-a")
        assert not cache_choices(url, "tenant-a")
        assert not cache_choices(url)
    with history_server(shared_history=True) as (url, _):  # ...unless every client may share one history
        assert not cache_choices(url, "tenant-a")
        assert cache_choices(url, "tenant-b")
