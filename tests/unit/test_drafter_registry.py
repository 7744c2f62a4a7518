"""Drafting methods come from one registry: a method registered there is validated, listed and
served by name, with no other file naming it."""
import argparse

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.drafters import registry
from specdec.drafters.base import Drafter
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, Proposal, SamplingParams, SpecConfig, SpecdecError

pytestmark = pytest.mark.timeout(60)


class RepeatDrafter(Drafter):
    """A toy: proposes the last committed token k times."""

    name = "repeat"

    def propose(self, context, k, sampling, rng, guide=None) -> Proposal:
        return Proposal(tuple(context[-1:]) * k)


@pytest.fixture
def repeat():
    method = registry.register(registry.Method("repeat", "the last token again", lambda parts: RepeatDrafter()))
    try:
        yield method
    finally:
        registry.unregister("repeat")


def test_builtin_methods_in_their_order():
    assert registry.method_names() == ("off", "ngram", "draft", "auto")
    assert [m.name for m in registry.methods() if m.wants_draft] == ["draft", "auto"]
    assert registry.DRAFT_FREE == ("ngram", "cache") and registry.MODEL_SOURCES == ("draft", "hybrid")
    assert registry.HISTORY_SOURCES == {"cache", "hybrid"}
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.Method("ngram", "again", lambda parts: RepeatDrafter()))


def test_without_a_draft_model_the_methods_that_need_one_are_not_served():
    assert Engine(FakeBackend(seed=7)).methods == ["off", "ngram", "auto"]


def test_a_registered_method_is_validated_and_served_by_name(repeat):
    SpecConfig("repeat").validate()
    from specdec.config_flags import add_method_arguments

    parser = argparse.ArgumentParser()
    add_method_arguments(parser)
    assert parser.parse_args(["--method", "repeat"]).method == "repeat"

    engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6))
    assert engine.methods == ["off", "ngram", "draft", "auto", "repeat"]
    prompt = tuple(engine.encode_prompt("the the the cat", chat=True))

    def run(method):
        return engine.generate(GenerationRequest(prompt, 30, SamplingParams(), SpecConfig(method, 3)))

    plain, repeated = run("off"), run("repeat")
    assert repeated.token_ids == plain.token_ids  # exact whatever the drafter proposes
    assert repeated.stats["drafted_tokens"] > 0


def test_the_server_accepts_a_registered_method(repeat):
    engine = Engine(FakeBackend(seed=7, n_ctx=256), FakeBackend(seed=7, noise=0.6, n_ctx=256))
    with serve_in_thread(create_app(engine, ServerConfig(served_model_name="fake"))) as (url, _):
        def chat(method):
            body = {"model": "fake", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 4,
                    "speculative_decoding": {"method": method}}
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)

        assert chat("repeat").status_code == 200, chat("repeat").text
        refused = chat("medusa")
        assert refused.status_code == 400
        assert "'repeat'" in refused.json()["error"]["message"]
        schema = httpx.get(url + "/openapi.json", timeout=30).json()["components"]["schemas"]["SpeculativeDecoding"]
        assert "repeat" in schema["properties"]["method"]["anyOf"][0]["enum"]


def test_an_unregistered_method_is_refused():
    with pytest.raises(SpecdecError, match="unknown speculative method 'repeat'; choose one of off, ngram, draft, auto"):
        SpecConfig("repeat").validate()
