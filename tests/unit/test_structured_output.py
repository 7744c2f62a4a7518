"""response_format over HTTP with real clients on the fake backend: JSON objects and JSON Schemas
enforced under every method with identical greedy text, the `openai` SDK's parse() with a pydantic
model, streaming, and schemas the grammar library cannot enforce refused with a 400 naming them."""
import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(120)

MODEL = "fake-target"
METHODS = ["off", "ngram", "draft", "auto"]


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "mat"]
    count: int = pydantic.Field(ge=0, le=99)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "animal": {"enum": ["cat", "mat"]}},
          "required": ["name", "animal"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=4)
    app = create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4)))
    with serve_in_thread(app) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, response_format, method="off", **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the cat sat on the mat"}], temperature=0,
        max_tokens=150, response_format=response_format,
        extra_body={"speculative_decoding": {"method": method, "num_speculative_tokens": 4}}, **kw)


def test_json_object_under_every_method_is_the_same_json(client):
    texts = {method: chat(client, {"type": "json_object"}, method).choices[0].message.content for method in METHODS}
    assert len(set(texts.values())) == 1
    assert isinstance(json.loads(texts["off"]), dict)


def test_json_schema_enforced_and_identical_across_methods(client):
    form = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    responses = {method: chat(client, form, method) for method in METHODS}
    texts = {method: r.choices[0].message.content for method, r in responses.items()}
    assert len(set(texts.values())) == 1
    value = json.loads(texts["off"])
    assert set(value) == {"name", "animal"} and value["animal"] in ("cat", "mat") and len(value["name"]) <= 10
    assert responses["ngram"].usage.model_extra["speculative"]["sources"]["grammar"]["accepted"] > 0


def test_openai_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(model=MODEL, messages=[{"role": "user", "content": "an item"}], temperature=0,
                       max_tokens=150, response_format=Item)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Item) and len(parsed.name) <= 10


def test_streamed_json_schema_equals_the_whole_response(client):
    form = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    whole = chat(client, form, "draft").choices[0].message.content
    stream = chat(client, form, "draft", stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == whole


@pytest.mark.parametrize("response_format, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "u", "schema": {"$ref": "#/$defs/nowhere"}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {"type": "object"}}},
     "response_format.json_schema.name", "pattern"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name",
     "required"),
    ({"type": "yaml"}, "response_format", ""),
    ({"type": "json_schema", "json_schema": {"name": "deep", "schema": json.loads(
        '{"type": "array", "items": ' * 200 + '{"type": "string"}' + "}" * 200)}},
     "response_format.json_schema.schema", ""),
])
def test_schemas_it_cannot_enforce_are_400s(server, response_format, param, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": response_format}
    response = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").startswith(param.split(".")[0])
    assert words in error["message"]


def test_completions_take_response_format_too(server):
    body = {"model": MODEL, "prompt": "the cat", "temperature": 0, "max_tokens": 150,
            "response_format": {"type": "json_object"}}
    response = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert isinstance(json.loads(response.json()["choices"][0]["text"]), dict)
