"""The agent APIs on fake backends, through their official clients: OpenAI's Responses API
(`openai` SDK's responses.create and streaming) and Anthropic's Messages API (`anthropic` SDK's
messages.create, messages.stream, messages.parse): text, tool-call round trips, namespaces,
built-in tools left out, the store, structured output, errors in each API's own shape; the same
greedy text as chat completions under every method (one serving layer). Also: forced tool calls
end when the model ends them, a list of prompts on /v1/completions."""
import json
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from fakes.scripted import ScriptedBackend
from pydantic import BaseModel

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(120)

MODEL = "fake-target"
MARKERS = [b"<tool_call>", b"</tool_call>"]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}


def block(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


PARIS = block("get_weather", {"city": "Paris", "days": 2})
SCRIPTS = {
    "ONE-CALL": PARIS,
    "CALL-THEN-NEWLINE": PARIS + "\n",  # the newline Qwen writes before another call, then the end
    "NS-CALL": block("weather__get_weather", {"city": "Oslo", "days": 1}),
    "SAY-STOP": "alpha beta STOP gamma",
    "PLAIN": "The answer is 42.",
}
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


def scripted_engine():
    return Engine(ScriptedBackend(SCRIPTS, seed=7, extra_special_pieces=MARKERS),
                  FakeBackend(seed=7, noise=0.6, extra_special_pieces=MARKERS), n_slots=4)


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4),
                          api_keys=tuple(KEYS.items()))
    with serve_in_thread(create_app(scripted_engine(), config)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="key-a", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="key-a", max_retries=0, timeout=60)


WEATHER_FN = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": WEATHER_SCHEMA}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}


def chat_text(oai, prompt, method="off", max_tokens=40):
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body={"speculative_decoding": {"method": method}})
    return response.choices[0].message.content


# -- Responses -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["off", "ngram", "draft", "auto"])
def test_responses_text_equals_chat_completions_under_every_method(oai, method):
    expected = chat_text(oai, "tell me about cats", "off")
    response = oai.responses.create(model=MODEL, input="tell me about cats", max_output_tokens=40, temperature=0,
                                    extra_body={"speculative_decoding": {"method": method}})
    assert response.output_text == expected
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 40 and response.usage.input_tokens > 0
    assert response.output[0].type == "message" and response.output[0].role == "assistant"


def test_responses_function_call_round_trip_with_previous_response_id(oai, server):
    first = oai.responses.create(model=MODEL, input="ONE-CALL please", tools=[WEATHER_FN], temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert first.status == "completed"
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER_FN], temperature=0,
                                  max_output_tokens=8,
                                  input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "sunny, 21 C"}])
    # The stored conversation came first: the prompt holds the first turn, its call and the result.
    assert second.usage.input_tokens > first.usage.input_tokens
    stored = httpx.get(f"{server}/v1/responses/{first.id}", headers={"Authorization": "Bearer key-a"})
    assert stored.status_code == 200 and stored.json()["output"][0]["call_id"] == calls[0].call_id
    # Another tenant's key sees nothing of it.
    other = httpx.get(f"{server}/v1/responses/{first.id}", headers={"Authorization": "Bearer key-b"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"


def test_responses_resent_history_as_codex_sends_it(oai):
    """Codex: store false, developer messages, the whole history resent with its call items."""
    response = oai.responses.create(model=MODEL, store=False, tools=[WEATHER_FN, {"type": "web_search"}],
                                    temperature=0, max_output_tokens=8, input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are terse."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ], extra_body={"prompt_cache_key": "thread-1", "client_metadata": {"x": "y"}},
        include=["reasoning.encrypted_content"], reasoning={"summary": "auto"}, parallel_tool_calls=True)
    assert response.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)  # store: false keeps nothing


def test_responses_namespace_tool_calls_name_their_namespace(oai):
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": [WEATHER_FN]}
    response = oai.responses.create(model=MODEL, input="NS-CALL", tools=[namespace], temperature=0)
    call = response.output[0].model_dump()
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "get_weather", "weather")
    assert json.loads(call["arguments"]) == {"city": "Oslo", "days": 1}


def test_responses_streaming_event_sequence(oai):
    events = list(oai.responses.create(model=MODEL, input="ONE-CALL", tools=[WEATHER_FN], temperature=0,
                                       stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.output_item.done").item
    assert done.type == "function_call" and json.loads(arguments) == json.loads(done.arguments)
    text_events = list(oai.responses.create(model=MODEL, input="PLAIN", temperature=0, stream=True))
    text = "".join(e.delta for e in text_events if e.type == "response.output_text.delta")
    final = text_events[-1].response
    assert text == final.output_text == "The answer is 42."
    assert [e.type for e in text_events if "content_part" in e.type or "text.done" in e.type] == [
        "response.content_part.added", "response.output_text.done", "response.content_part.done"]


def test_responses_refusals_are_openai_shaped_400s(oai):
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert error.value.body["code"] == "unsupported_content"
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}],
                             tool_choice={"type": "web_search"})
    assert error.value.body["param"] == "tool_choice"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")


def test_responses_json_schema_text_format(oai):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response = oai.responses.create(model=MODEL, input="a number", temperature=0, max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    value = json.loads(response.output_text)
    assert set(value) == {"n"} and 0 <= value["n"] <= 9


# -- Messages ------------------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # today's anthropic SDK takes no sampling fields; older clients send them
@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_messages_text_equals_chat_completions_under_every_method(claude, oai, method):
    expected = chat_text(oai, "tell me about cats", "off")
    message = claude.messages.create(model=MODEL, max_tokens=40,
                                     messages=[{"role": "user", "content": "tell me about cats"}],
                                     extra_body={"temperature": 0, "speculative_decoding": {"method": method}})
    assert message.content[0].text == expected and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 40


def test_messages_tool_use_round_trip(claude):
    first = claude.messages.create(model=MODEL, max_tokens=32000, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                   messages=[{"role": "user", "content": "ONE-CALL"}])
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris", "days": 2})
    second = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "ONE-CALL"},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny",
                                      "is_error": False}]}])
    def prompt(usage):  # Anthropic's input_tokens leaves out the cache reads
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt(second.usage) > prompt(first.usage)


def test_messages_stream_as_the_sdk_assembles_it(claude):
    with claude.messages.stream(model=MODEL, max_tokens=400, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                messages=[{"role": "user", "content": "ONE-CALL"}]) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris", "days": 2}
    with claude.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "PLAIN"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == "The answer is 42." and final.stop_reason == "end_turn"


def test_messages_stop_sequence_is_named(claude):
    message = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, stop_sequences=["STOP"],
                                     messages=[{"role": "user", "content": "SAY-STOP"}])
    assert message.content[0].text == "alpha beta " and message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "STOP"


def test_messages_parse_holds_the_output_to_the_schema(claude):
    class Answer(BaseModel):
        answer: Literal["yes", "no"]

    message = claude.messages.parse(model=MODEL, max_tokens=40, extra_body=GREEDY, output_format=Answer,
                                    messages=[{"role": "user", "content": "yes or no?"}])
    assert isinstance(message.parsed_output, Answer)


def test_messages_what_claude_code_sends_is_accepted(server, claude):
    """System blocks and a system message inside messages, cache_control, thinking, betas; the
    attribution line does not change the prompt."""
    def body(billing):
        system = [{"type": "text", "text": billing + "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
        return {"model": MODEL, "max_tokens": 32000, "system": system, "stream": False,
                "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
                "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
                "tools": [{**WEATHER_TOOL, "defer_loading": True}],
                "messages": [{"role": "system", "content": "More rules."},
                             {"role": "user", "content": [{"type": "text", "text": "hi",
                                                           "cache_control": {"type": "ephemeral"}}]}]}
    headers = {"x-api-key": "key-a", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}
    counts = []
    for billing in ("", "x-anthropic-billing-header: cc_version=2.1.332.a1b; cc_entrypoint=sdk-cli; cch=9f2e;\n"):
        reply = httpx.post(f"{server}/v1/messages?beta=true", json=body(billing), headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
        counted = httpx.post(f"{server}/v1/messages/count_tokens?beta=true", headers=headers, timeout=60,
                             json={k: v for k, v in body(billing).items() if k in ("model", "system", "messages",
                                                                                    "tools")})
        usage = reply.json()["usage"]
        counts.append((usage["input_tokens"] + usage["cache_read_input_tokens"], counted.json()["input_tokens"]))
    assert counts[0] == counts[1] and counts[0][0] == counts[0][1]


def test_messages_errors_are_anthropic_shaped(server, claude):
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    bad = httpx.post(f"{server}/v1/messages", content=b"{", headers={"x-api-key": "key-a"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"


# -- tool calls that end, several prompts --------------------------------------------------------
@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_end_when_the_model_ends_them(oai, method, choice):
    response = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "CALL-THEN-NEWLINE"}], temperature=0, max_tokens=200,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}],
        tool_choice=choice, extra_body={"speculative_decoding": {"method": method}})
    choice_out = response.choices[0]
    assert choice_out.finish_reason == "tool_calls" and len(choice_out.message.tool_calls) == 1
    assert choice_out.message.content is None


def test_a_list_of_prompts_gives_each_its_choices(oai):
    prompts = ["tell me about cats", "PLAIN"]
    response = oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    alone = [oai.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert response.usage.completion_tokens == 4 * 6


@pytest.mark.parametrize("method", ["off", "ngram", "draft", "auto"])
def test_logit_bias_is_applied_to_the_target_under_every_method(oai, server, method):
    def ask(**extra):
        return oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "PLAIN"}], max_tokens=8, temperature=0,
            extra_body={"speculative_decoding": {"method": method}}, **extra).choices[0].message.content

    first = httpx.post(f"{server}/tokenize", json={"content": "The answer is 42."},
                       headers={"Authorization": "Bearer key-a"}).json()["tokens"][0]
    assert ask().startswith("The answ")  # 8 tokens of the script
    banned = ask(logit_bias={str(first): -100})
    assert not banned.startswith("The answ")
    off = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "PLAIN"}], max_tokens=8,
                                      temperature=0, logit_bias={str(first): -100},
                                      extra_body={"speculative_decoding": {"method": "off"}})
    assert banned == off.choices[0].message.content
    for bad in ({"99999999": 5}, {"1": 101}, {"x": 1}):
        with pytest.raises(openai.BadRequestError) as error:
            ask(logit_bias=bad)
        assert error.value.body["param"].startswith("logit_bias")


def test_responses_custom_tool_with_a_regex_format_is_held_to_it(oai):
    tool = {"type": "custom", "name": "set_code", "description": "A three-digit code.",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}"}}
    response = oai.responses.create(model=MODEL, input="a code", tools=[tool], temperature=0, max_output_tokens=80,
                                    tool_choice={"type": "custom", "name": "set_code"})
    call = response.output[0].model_dump()
    assert (call["type"], call["name"]) == ("custom_tool_call", "set_code")
    assert len(call["input"]) == 3 and call["input"].isdigit()
