"""The stream's `speculative` extension (server/speculative.py): per chunk, who produced its
tokens and what each round proposed; absent unless asked. And the playground's routes: its page
needs no key, the costs it shows do."""
import json

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.pieces import TokenPieces
from specdec.server.speculative import SourceAnnotator
from specdec.server.testing import serve_in_thread
from specdec.types import RoundOutcome, SpecConfig, StreamEvent

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-target"
PROMPT = "the cat sat on the mat"


def make_engine():
    return Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=4)


@pytest.fixture(scope="module")
def url():
    app = create_app(make_engine(), ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4)))
    with serve_in_thread(app) as (base, _):
        yield base


def chat_body(method="draft", stream=True, stream_options=None, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 60,
            "speculative_decoding": {"method": method, "num_speculative_tokens": 4}, "stream": stream, **extra}
    if stream_options is not None:
        body["stream_options"] = stream_options
    return body


def stream_chunks(url, body, headers=None):
    """Every `data:` payload of a streamed completion but `[DONE]`, parsed."""
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def content_of(chunks):
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])


@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_sources_add_up_to_the_completion_tokens(url, method):
    chunks = stream_chunks(url, chat_body(method, stream_options={"include_usage": True, "speculative": True}))
    usage = chunks[-1]["usage"]
    stats = usage["speculative"]
    extensions = [chunk["speculative"] for chunk in chunks if "speculative" in chunk]
    sources = [source for extension in extensions for source in extension["sources"]]
    assert len(sources) == usage["completion_tokens"] > 0
    assert sources.count("target") == len(sources) - stats["accepted_tokens"]
    assert set(sources) <= {"target", method}
    rounds = [round_ for extension in extensions for round_ in extension["rounds"]]
    assert len(rounds) == sum(stats["choices"].values())  # every round, those without a proposal too
    assert sum(r["proposed"] for r in rounds) == stats["drafted_tokens"]
    assert sum(r["accepted"] for r in rounds) == stats["accepted_tokens"]
    assert all("rejected" not in r for r in rounds)  # only when asked
    if method == "draft":  # the fake draft agrees with the target most of the time
        assert "draft" in sources and {r["method"] for r in rounds} <= {"draft", "none"}
    # Every content chunk carries its tokens' sources; the text is what a plain request gets.
    with_text = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["delta"].get("content")]
    assert all("speculative" in chunk for chunk in with_text)
    plain = httpx.post(url + "/v1/chat/completions", json=chat_body(method, stream=False), timeout=30).json()
    assert content_of(chunks) == plain["choices"][0]["message"]["content"]


def test_absent_unless_asked(url):
    for options in (None, {"include_usage": True}, {"speculative": False}):
        chunks = stream_chunks(url, chat_body(stream_options=options))
        assert chunks and all("speculative" not in chunk for chunk in chunks), options
    plain = httpx.post(url + "/v1/chat/completions", json=chat_body(stream=False), timeout=30).json()
    assert "speculative" not in plain


def test_rejected_proposals_when_asked(url):
    chunks = stream_chunks(url, chat_body(stream_options={"speculative": {"rejected": True}}))
    rounds = [r for chunk in chunks if "speculative" in chunk for r in chunk["speculative"]["rounds"]]
    rejected = [r for r in rounds if r["accepted"] < r["proposed"]]
    assert rejected, "the fake draft model should miss now and then"
    assert all(r["rejected"] for r in rejected)
    assert all("rejected" not in r for r in rounds if r["accepted"] == r["proposed"])


def test_text_completions_carry_it_too_and_stop_strings_keep_the_count(url):
    full = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 60,
                                                     "temperature": 0, "ignore_eos": True}, timeout=30).json()
    text = full["choices"][0]["text"]
    stop = text[20:23]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stop": [stop],
            "stream": True, "stream_options": {"include_usage": True, "speculative": True},
            "speculative_decoding": {"method": "ngram"}}
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text[:text.index(stop)]
    sources = [s for c in chunks if "speculative" in c for s in c["speculative"]["sources"]]
    assert len(sources) == chunks[-1]["usage"]["completion_tokens"]


def test_annotator_cuts_per_token_and_keeps_cut_tokens_for_the_end():
    backend = FakeBackend()
    ids = {piece: i for i, piece in enumerate(backend.pieces)}
    the, e1, e2, mat = ids[b"the "], ids[b"\xc3"], ids[b"\xa9"], ids[b"mat"]
    annotator = SourceAnnotator(TokenPieces(backend.token_bytes), backend.token_bytes, rejected=True)
    first = annotator.split(StreamEvent("the é", [the, e1, e2], token_sources=["draft", "draft", "target"],
                                        round=RoundOutcome("draft", 3, 2, (mat,))))
    assert [(text, ext.sources) for text, ext in first] == [("the ", ["draft"]), ("é", ["draft", "target"])]
    assert first[-1][1].rounds[0].rejected == "mat" and not first[0][1].rounds
    # A token whose text a stop string cut: no piece carries it, the finish_reason chunk does.
    assert annotator.split(StreamEvent("", [mat], "stop", {}, ["target"], round=RoundOutcome("", 0, 0))) == []
    rest = annotator.rest()
    assert rest.sources == ["target"] and [r.method for r in rest.rounds] == ["none"]


def test_rejected_text_from_a_shared_history_is_withheld():
    backend = FakeBackend()
    annotator = SourceAnnotator(TokenPieces(backend.token_bytes), backend.token_bytes, rejected=True,
                                hidden_sources=frozenset({"cache"}))
    mat = backend.pieces.index(b"mat")
    pieces = annotator.split(StreamEvent("the ", [backend.pieces.index(b"the ")], token_sources=["target"],
                                         round=RoundOutcome("cache", 1, 0, (mat,))))
    assert pieces[0][1].rounds[0].rejected is None and pieces[0][1].rounds[0].method == "cache"


def test_token_pieces_count_the_tokens_ending_in_each():
    backend = FakeBackend()
    ids = [backend.pieces.index(p) for p in (b"the ", b"\xc3", b"\xa9", b"!")]
    assert TokenPieces(backend.token_bytes).split_counted("the é!", ids) == [("the ", 1), ("é", 2), ("!", 1)]


def test_the_chunk_schema_documents_the_extension(url):
    schemas = httpx.get(url + "/openapi.json", timeout=10).json()["components"]["schemas"]
    assert "speculative" in schemas["ChatCompletionChunk"]["properties"]
    assert set(schemas["SpeculativeChunk"]["required"]) == {"sources", "rounds"}
    assert "speculative" in schemas["StreamOptions"]["properties"]


# -- the playground's routes -------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_url():
    app = create_app(make_engine(), ServerConfig(served_model_name=MODEL, api_key="sk-test"))
    with serve_in_thread(app) as (base, _):
        yield base


@pytest.mark.parametrize("path, kind", [("/", "text/html"), ("/static/playground.js", "text/javascript"),
                                        ("/static/playground.css", "text/css")])
def test_the_page_needs_no_key_and_fetches_nothing_from_elsewhere(keyed_url, path, kind):
    response = httpx.get(keyed_url + path, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    assert "connect-src 'self'" in response.headers["content-security-policy"]
    assert "http://" not in response.text and "https://" not in response.text


def test_costs_need_the_key_and_show_t1_and_v(keyed_url):
    assert httpx.get(keyed_url + "/v1/specdec/costs", timeout=10).status_code == 401
    assert httpx.get(keyed_url + "/metrics", timeout=10).status_code == 401
    costs = httpx.get(keyed_url + "/v1/specdec/costs", headers={"Authorization": "Bearer sk-test"}, timeout=10).json()
    assert costs["calibrated"] and costs["slots"] == 4
    assert costs["target_step_seconds"] > 0 and costs["v"]["1"] == pytest.approx(1.0)
    assert costs["summary"].startswith("t(1)")
