"""OpenAI tool calling (server/tools.py) on fake backends: malformed tools are 400s naming the
field; tools and earlier calls reach the model's chat template; `<tool_call>` blocks come back as
`tool_calls`, whole and streamed (assembled by the `openai` client); the grammar holds calls to the
declared names and argument schemas, the same under every speculative method."""
import json
import random

import httpx
import jsonschema
import openai
import pytest
from fakes.scripted import ScriptedBackend

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.grammar import GrammarCompiler
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.server.tools import ToolSetup, ToolStreamParser, marker_tokens, parse_output, tool_grammar
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(120)

MODEL = "fake-target"
MARKERS = [b"<tool_call>", b"</tool_call>"]
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WEATHER_PARAMETERS}}
# Arguments a random model finishes quickly: an enum and a one-digit integer.
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]},
                                                    "hour": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["zone", "hour"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}
TOOLS = [WEATHER, TIME]
QWEN_TEMPLATE = (__import__("pathlib").Path(__file__).parents[1] / "data" / "qwen2.5_chat_template.jinja").read_text()


def block(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


PARIS = block("get_weather", {"city": "Paris", "days": 2})
CET = block("get_time", {"zone": "CET", "hour": 3})
SCRIPTS = {"ONE-CALL": PARIS, "TWO-CALLS": "Let me look.\n" + PARIS + "\n" + CET, "NO-CALL": "No tools needed."}


def scripted_engine(markers=False):
    extra = MARKERS if markers else ()
    return Engine(ScriptedBackend(SCRIPTS, seed=7, extra_special_pieces=extra),
                  FakeBackend(seed=7, noise=0.6, extra_special_pieces=extra), n_slots=4)


@pytest.fixture(scope="module", params=["text markers", "marker tokens"])
def server(request):
    engine = scripted_engine(markers=request.param == "marker tokens")
    app = create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4)))
    with serve_in_thread(app) as (url, _):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 400)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def post(url, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


# -- validation ----------------------------------------------------------------------------------
def nested(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def function(name="f", **fields):
    return {"type": "function", "function": {"name": name, **fields}}


CALLED = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("fields, param", [
    ({"tools": [function("bad name")]}, "tools[0].function.name"),
    ({"tools": [function("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [function("")]}, "tools[0].function.name"),
    ({"tools": [function("f"), function("g"), function("f")]}, "tools[2].function.name"),
    ({"tools": [function(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [function(parameters=[1, 2])]}, "tools[0].function.parameters"),
    ({"tools": [function(parameters={"type": "object", "properties": {"a": {"type": "strnig"}}})]},
     "tools[0].function.parameters"),
    ({"tools": [function(parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}})]},
     "tools[0].function.parameters"),
    ({"tools": [function(parameters={"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}})]},
     "tools[0].function.parameters"),
    ({"tools": [function(parameters=nested(100))]}, "tools[0].function.parameters"),
    ({"tools": [function(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [function(f"f{i}") for i in range(129)]}, "tools"),
    ({"tools": "f"}, "tools"),
    ({"tools": [function()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ({"tools": [function()], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [function()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_1"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALLED]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALLED, "function": {"name": "f", "arguments": {"a": 1}}}]}]}, "messages[0].tool_calls[0].function.arguments"),
])
def test_malformed_tools_are_400s_naming_the_field(server, fields, param):
    response = post(server[0], **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_unknown_fields_in_tool_definitions_are_ignored_and_named(server):
    response = post(server[0], tools=[{"type": "function", "cache_control": {"type": "ephemeral"},
                                       "function": {"name": "f", "defer_loading": True}}])
    assert response.status_code == 200, response.text
    assert response.headers["x-specdec-ignored-fields"] == "tools[].cache_control, tools[].function.defer_loading"


def test_tools_larger_than_the_limit_are_refused_before_any_work(server):
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(12000)}}
    error = post(server[0], tools=[function(parameters=huge)]).json()["error"]
    assert error["param"] == "tools" and "bytes" in error["message"]
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(8000)}}
    error = post(server[0], tools=[function(parameters=wide)]).json()["error"]  # more than the context holds
    assert error["code"] == "context_length_exceeded"


def test_well_formed_tool_requests_pass(server):
    for fields in ({"tools": [function()], "tool_choice": "none"}, {"tools": [], "tool_choice": "auto"},
                   {"tools": [function(parameters={})], "parallel_tool_calls": False},
                   {"tools": [function(description="d", parameters=WEATHER_PARAMETERS, strict=True)]},
                   # arguments that are not JSON reach the template as text
                   {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
                       {**CALLED, "function": {"name": "f", "arguments": "{cut sh"}}]}]}):
        response = post(server[0], **fields)
        assert response.status_code == 200, (fields, response.text)


# -- rendering -----------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]


def test_tool_messages_and_assistant_calls_are_accepted(client):
    response = client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, temperature=0,
                                              max_tokens=8)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # A tool message's content may be text parts; earlier calls render without tools too.
    parts = [*CONVERSATION[:2], {**CONVERSATION[2], "content": [{"type": "text", "text": "sunny"}]}]
    response = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=8)
    assert response.usage.prompt_tokens > 0


def test_qwen_template_renders_tools_calls_and_responses():
    engine = Engine(FakeBackend(chat_template=QWEN_TEMPLATE, extra_special_pieces=MARKERS), None, n_slots=1)
    from specdec.server.protocol import ChatCompletionRequest
    from specdec.server.convert import encode_prompt

    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": CONVERSATION, "tools": [WEATHER]})
    ids = encode_prompt(engine, body)
    text = b"".join(engine.target.token_bytes(t) for t in ids).decode()
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    # arguments as the object they encode, as the template expects (not a JSON string of JSON)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the template's own markers are the marker tokens
    open_id = engine.target.tokenize("<tool_call>")[0]
    assert ids.count(open_id) == 3  # the tools section's two in its format lines, and the earlier call


def test_special_token_text_in_tools_stays_plain_text():
    engine = Engine(FakeBackend(chat_template=QWEN_TEMPLATE, extra_special_pieces=MARKERS), None, n_slots=1)
    open_id = engine.target.tokenize("<tool_call>")[0]
    tool = function("f", description="write <tool_call> to call me")
    with_text = engine.encode_prompt([{"role": "user", "content": "hi"}], chat=True, tools=[tool])
    plain = engine.encode_prompt([{"role": "user", "content": "hi"}], chat=True, tools=[function("f")])
    assert with_text.count(open_id) == plain.count(open_id) == 2  # the template's own markers only
    text = b"".join(engine.target.token_bytes(t) for t in with_text).decode()
    assert "write <tool_call> to call me" in text


def test_tool_choice_none_renders_without_tools_and_reads_no_calls(client):
    with_tools = ask(client, "ONE-CALL")
    none = ask(client, "ONE-CALL", tool_choice="none")
    assert none.usage.prompt_tokens < with_tools.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"


# -- parsing -------------------------------------------------------------------------------------
def calls_of(parsed):
    return [(call.function.name, call.function.arguments) for call in parsed.tool_calls]


def test_parse_one_call():
    parsed = parse_output(PARIS)
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", '{"city": "Paris", "days": 2}')]
    assert parsed.tool_calls[0].id.startswith("call_") and parsed.tool_calls[0].type == "function"


def test_parse_parallel_calls_and_text_around_them():
    parsed = parse_output("Let me look.\n" + PARIS + "\n" + CET + "\nDone.")
    assert parsed.content == "Let me look.Done."
    assert calls_of(parsed) == [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "CET", "hour": 3}')]
    assert len({call.id for call in parsed.tool_calls}) == 2


def test_parse_keeps_the_models_argument_text():
    parsed = parse_output('<tool_call>\n{"name": "f", "arguments": {"b":1,  "a": [1, {"c": "}"}]}}\n</tool_call>')
    assert calls_of(parsed) == [("f", '{"b":1,  "a": [1, {"c": "}"}]}')]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}, "extra": 1}\n</tool_call>',
    "text <tool_call",
    "plain text, no call",
    "",
])
def test_what_is_no_call_stays_content_as_written(text):
    parsed = parse_output(text)
    assert parsed.content == text and parsed.tool_calls == []


@pytest.mark.parametrize("text, content", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', None),
    ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1', "Let me look."),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na', None),
])
def test_a_call_cut_short_is_neither_call_nor_content(text, content):
    """max_tokens inside a call: its raw markup is never returned as text."""
    parsed = parse_output(text)
    assert parsed.content == content
    assert "<tool_call>" not in (parsed.content or "")
    assert len(parsed.tool_calls) == text.count("</tool_call>")


def test_a_malformed_block_beside_a_call_stays_content():
    bad = "<tool_call>\n{oops}\n</tool_call>"
    parsed = parse_output(bad + "\n" + PARIS)
    assert parsed.content == bad and calls_of(parsed) == [("get_weather", '{"city": "Paris", "days": 2}')]


def test_arguments_written_as_a_string_pass_through():
    parsed = parse_output('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>')
    assert calls_of(parsed) == [("f", '{"a": 1}')]


STREAM_CASES = [
    PARIS, "Let me look.\n" + PARIS + "\n" + CET, "No tools.", "a < b <tool_ca but no call", "  spaced  ",
    "<tool_call>\n{broken}\n</tool_call> then " + PARIS + " and after", PARIS + "\n\n  tail text",
    '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"s": "}</tool_call>{\\"", "n": [1, 2]}}\n</tool_call>',
    "<tool_call>\n{unterminated", "x<tool_call><tool_call>\n" + PARIS[len("<tool_call>\n"):],
]


def assemble(items):
    content, calls = "", {}
    for item in items:
        if isinstance(item, str):
            content += item
            continue
        call = calls.setdefault(item.index, {"id": item.id, "name": item.function.name, "arguments": ""})
        assert item.id is None or item.id == call["id"]
        call["arguments"] += item.function.arguments or ""
    return content or None, [(call["name"], call["arguments"]) for _, call in sorted(calls.items())]


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streamed_parse_equals_the_whole_parse_however_the_text_is_cut(text):
    whole = parse_output(text)
    rng = random.Random(len(text))
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        if trial == 0:
            pieces = list(text)  # one character at a time
        parser = ToolStreamParser()
        items = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
        assert assemble(items) == (whole.content, calls_of(whole)), pieces


def test_text_that_may_begin_a_call_is_held_back():
    parser = ToolStreamParser()
    assert parser.feed("Sure <tool") == ["Sure"]
    assert parser.feed("_c") == []
    assert parser.feed("at!") == [" <tool_cat!"]


# -- through the server ---------------------------------------------------------------------------
def test_one_call(client):
    response = ask(client, "ONE-CALL")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_parallel_calls_with_text_before(client):
    choice = ask(client, "TWO-CALLS").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET", "hour": 3})]


def test_an_answer_without_calls(client):
    choice = ask(client, "NO-CALL").choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "No tools needed."
    assert choice.message.tool_calls is None


def test_a_call_cut_by_max_tokens_is_no_content_with_finish_length(client):
    choice = ask(client, "ONE-CALL", max_tokens=20).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert "<tool_call>" not in (choice.message.content or "")
    streamed = list(ask(client, "ONE-CALL", max_tokens=20, stream=True))
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)


@pytest.mark.parametrize("prompt", ["ONE-CALL", "TWO-CALLS", "NO-CALL"])
@pytest.mark.parametrize("method", ["off", "draft", "ngram"])
def test_streamed_calls_as_the_openai_client_assembles_them(client, prompt, method):
    extra = {"speculative_decoding": {"method": method}}
    whole = ask(client, prompt, extra_body=extra).choices[0]
    chunks = list(ask(client, prompt, stream=True, extra_body=extra))
    seen = set()
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            first = delta.index not in seen
            seen.add(delta.index)
            # the first chunk of a call names it; the later ones carry only arguments
            assert (delta.id is not None, delta.type is not None, delta.function.name is not None) == (first,) * 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.finish_reason]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], tools=TOOLS, temperature=0,
                  max_tokens=400, extra_body=extra)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason
    assert (final.message.content or None) == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or ()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]


# -- the grammar ---------------------------------------------------------------------------------
def constraint(backend, choice="auto", forced=None, parallel=True, tools=TOOLS):
    setup = ToolSetup(tuple({"type": "function", "function": t["function"]} for t in tools), choice, forced, parallel)
    return GrammarCompiler(backend).constraint(tool_grammar(setup, marker_tokens(backend)))


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("choice, forced, parallel, text, whole", [
    ("auto", None, True, "No tools needed.", True),
    ("auto", None, True, "", True),
    ("auto", None, True, PARIS, True),
    ("auto", None, True, "Let me look.\n" + PARIS + "\n" + CET, True),
    ("auto", None, False, PARIS + "\n" + CET, False),
    ("auto", None, True, PARIS + " and text after", False),
    ("auto", None, True, block("get_wether", {"city": "Paris", "days": 2}), False),
    ("auto", None, True, block("get_weather", {"city": "Paris", "days": 9}), False),
    ("auto", None, True, block("get_weather", {"city": "Paris"}), False),
    ("required", None, True, PARIS + "\n" + CET, True),
    ("required", None, True, "No tools needed.", False),
    ("required", None, False, PARIS + "\n" + CET, False),
    ("function", "get_time", True, CET, True),
    ("function", "get_time", True, PARIS, False),
])
def test_the_grammar_admits_calls_to_declared_tools_only(markers, choice, forced, parallel, text, whole):
    backend = FakeBackend(extra_special_pieces=MARKERS if markers else ())
    assert (marker_tokens(backend) is not None) == markers
    rule = constraint(backend, choice, forced, parallel)
    tokens = backend.tokenize(text)
    admitted = rule.admissible(tokens)
    if whole:
        assert admitted == len(tokens)
        rule.commit(tokens)
        assert rule.allowed_after([])[sorted(backend.eog_token_ids)].any()  # it may end here
    else:
        assert admitted < len(tokens) or not rule.allowed_after(tokens)[sorted(backend.eog_token_ids)].any()


def test_with_marker_tokens_a_call_begins_only_with_the_marker_token():
    backend = FakeBackend(extra_special_pieces=MARKERS)
    rule = constraint(backend)
    spelled = backend.tokenize("x " + PARIS, parse_special=False)  # "<tool_call>" as characters
    assert rule.admissible(spelled) < len(spelled)


@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", False), ("required", True), ({"type": "function", "function": {"name": "get_time"}}, False)])
def test_required_calls_from_an_unscripted_model_are_valid_and_method_independent(tool_choice, parallel):
    """A model that has never seen a tool (FakeBackend's random text) still calls: the grammar
    writes the format, a declared name, and arguments valid against its schema; greedy output is
    the same under every speculative method."""
    engine = Engine(FakeBackend(seed=3, eog_bias=2.0), FakeBackend(seed=3, noise=0.6, eog_bias=2.0), n_slots=2)
    app = create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4)))
    with serve_in_thread(app) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        outputs = []
        for method in ("off", "ngram", "draft"):
            response = ask(client, "the cat sat", tools=[WEATHER, TIME], tool_choice=tool_choice,
                           parallel_tool_calls=parallel, max_tokens=300,
                           extra_body={"speculative_decoding": {"method": method}})
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls
            assert calls and (parallel or len(calls) == 1) and choice.message.content is None
            for call in calls:
                schema = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), schema)
                if isinstance(tool_choice, dict):
                    assert call.function.name == "get_time"
            outputs.append([(c.function.name, c.function.arguments) for c in calls])
        assert outputs[0] == outputs[1] == outputs[2]


def test_arrays_nested_past_the_recursion_limit_are_text_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000
    text = f'<tool_call>\n{{"name": "f", "arguments": {{"a": {deep}}}}}\n</tool_call>'
    assert parse_output(text).content == text
    parser = ToolStreamParser()
    # streamed, the call was announced before it could be parsed: it stays, with the object's text
    assert assemble(parser.feed(text) + parser.finish()) == (None, [("f", f'{{"a": {deep}}}')])


def test_earlier_call_arguments_nested_past_the_recursion_limit_reach_the_template_as_text(server):
    deep = "[" * 3000 + "]" * 3000
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {**CALLED, "function": {"name": "f", "arguments": deep}}]}]
    response = post(server[0], messages=messages, tools=[function()])
    # rendered (as text), tokenized, then refused for the fake's context: never a 500
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_each_choice_parses_its_own_calls(client):
    whole = ask(client, "TWO-CALLS", n=2)
    streamed = list(ask(client, "TWO-CALLS", n=2, stream=True))
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 2
    for index in (0, 1):
        names = [d.function.name for c in streamed for ch in c.choices if ch.index == index
                 for d in ch.delta.tool_calls or () if d.function.name]
        assert names == ["get_weather", "get_time"]


def test_streamed_calls_keep_every_tokens_logprobs_and_source(client):
    """The parser holds text back and turns it into calls, but each token's log-probability and
    `speculative` source still go out once, on some chunk of the stream."""
    chunks = list(ask(client, "TWO-CALLS", stream=True, logprobs=True, stream_options={
        "include_usage": True, "speculative": True}))
    generated = chunks[-1].usage.completion_tokens
    logprobs = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    sources = [source for c in chunks if c.model_extra.get("speculative")
               for source in c.model_extra["speculative"]["sources"]]
    assert len(logprobs) == generated and len(sources) == generated
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert {d.function.name for d in deltas if d.function.name} == {"get_weather", "get_time"}


# -- bare calls: a turn that opens with the call's JSON, without tags ------------------------------
NAMES = frozenset({"get_weather", "get_time"})
BARE = [
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n```', None,
     [("get_weather", '{"city": "Paris", "days": 2}')]),
    ('{"name": "get_time", "parameters": {"zone": "UTC", "hour": 1}}', None, [("get_time", '{"zone": "UTC", "hour": 1}')]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n```\nDone.', "Done.",
     [("get_weather", '{"city": "Oslo", "days": 1}')]),
    # not a call: an undeclared name, other keys, JSON that is an answer, a call not at the start
    ('```json\n{"name": "rm_rf", "arguments": {}}\n```', '```json\n{"name": "rm_rf", "arguments": {}}\n```', []),
    ('{"name": "get_weather", "city": "Paris"}', '{"name": "get_weather", "city": "Paris"}', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('Sure: {"name": "get_weather", "arguments": {}}', 'Sure: {"name": "get_weather", "arguments": {}}', []),
    ('```python\nprint(1)\n```', '```python\nprint(1)\n```', []),
]


@pytest.mark.parametrize("text, content, calls", BARE)
def test_a_turn_opening_with_a_bare_call_is_that_call(text, content, calls):
    parsed = parse_output(text, NAMES)
    assert parsed.content == content and calls_of(parsed) == calls
    assert calls_of(parse_output(text)) == []  # without the tools' names, never a call


@pytest.mark.parametrize("text, content, calls", BARE)
def test_a_bare_call_streamed_in_any_pieces_is_the_same(text, content, calls):
    rng = random.Random(len(text))
    for _ in range(20):
        parser, items, position = ToolStreamParser(NAMES), [], 0
        while position < len(text):
            step = rng.randint(1, 6)
            items += parser.feed(text[position:position + step])
            position += step
        items += parser.finish()
        streamed_text = "".join(item for item in items if isinstance(item, str))
        streamed_calls = [(item.function.name, item.function.arguments) for item in items
                          if not isinstance(item, str) and item.id is not None]
        assert (streamed_text or None, streamed_calls) == (content, calls)
