"""The agent APIs on the real pair through their official clients, one server for the module:
Anthropic's Messages (`anthropic` SDK: messages.create with a tool and a tool_result round trip,
messages.stream, messages.parse with a pydantic model), OpenAI's Responses (`openai` SDK:
responses.create for text, a function-tool round trip with previous_response_id, streaming),
and tool calls forced through chat completions that end when the model ends them. On every
surface, every method's greedy output equals `off`'s."""
import json

import anthropic
import openai
import pytest
from pydantic import BaseModel

from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(900, method="thread")
MODEL = "qwen"
START_TIMEOUT = 300
METHODS = ("off", "ngram", "draft", "auto")
PROMPT = "Write a Python function that checks whether a string is a palindrome."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_QUESTION = "What's the weather like in Paris today?"


@pytest.fixture(scope="module")
def server(real_engine):
    app = create_app(real_engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("auto", 3),
                                               stall_timeout=1800))
    with serve_in_thread(app, timeout=START_TIMEOUT) as (url, _):
        yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=600)


def speculation(method, **extra):
    return {"speculative_decoding": {"method": method, "num_speculative_tokens": 3}, **extra}


def test_every_surface_gives_off_s_greedy_text_under_every_method(oai, claude):
    texts = {}
    for method in METHODS:
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=48, temperature=0, extra_body=speculation(method))
        responses = oai.responses.create(model=MODEL, input=PROMPT, max_output_tokens=48, temperature=0,
                                         extra_body=speculation(method))
        messages = claude.messages.create(model=MODEL, max_tokens=48, messages=[{"role": "user", "content": PROMPT}],
                                          extra_body=speculation(method, temperature=0))
        texts[method] = (chat.choices[0].message.content, responses.output_text, messages.content[0].text)
    off = texts["off"][0]
    assert off and all(text == off for method in METHODS for text in texts[method]), texts


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_end_with_the_call_the_model_means(oai, choice):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather.",
                                               "parameters": WEATHER_SCHEMA}}]
    outputs = set()
    for method in METHODS:
        response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": WEATHER_QUESTION}],
                                               tools=tools, tool_choice=choice, max_tokens=200, temperature=0,
                                               extra_body=speculation(method))
        out = response.choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None, method
        calls = [(call.function.name, json.loads(call.function.arguments)) for call in out.message.tool_calls]
        assert calls == [("get_weather", {"city": "Paris"})], method
        outputs.add(response.usage.completion_tokens)
    assert len(outputs) == 1  # the same tokens under every method


def test_messages_tool_use_round_trip_stream_and_parse(claude):
    tool = {"name": "get_weather", "description": "Get the current weather.", "input_schema": WEATHER_SCHEMA}
    first = claude.messages.create(model=MODEL, max_tokens=32000, tools=[tool], tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": WEATHER_QUESTION}],
                                   extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    history = [{"role": "user", "content": WEATHER_QUESTION},
               {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Sunny, 21 degrees Celsius."}]}]
    with claude.messages.stream(model=MODEL, max_tokens=64, tools=[tool], messages=history,
                                extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = claude.messages.create(model=MODEL, max_tokens=64, tools=[tool], messages=history,
                                   extra_body={"temperature": 0})
    # What a 1.5B model makes of the result is its own; the three readings of it agree.
    assert streamed and streamed == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.stop_reason in ("end_turn", "max_tokens", "tool_use")

    class Weather(BaseModel):
        city: str
        celsius: int

    parsed = claude.messages.parse(model=MODEL, max_tokens=64, output_format=Weather, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Paris is at 21 degrees Celsius. As JSON."}])
    assert parsed.parsed_output == Weather(city="Paris", celsius=21)


def test_responses_function_round_trip_and_streaming(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather.",
              "parameters": WEATHER_SCHEMA}]
    first = oai.responses.create(model=MODEL, input=WEATHER_QUESTION, tools=tools, tool_choice="required",
                                 temperature=0)
    call = first.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    follow_up = dict(model=MODEL, previous_response_id=first.id, tools=tools, temperature=0, max_output_tokens=64,
                     input=[{"type": "function_call_output", "call_id": call.call_id,
                             "output": "Sunny, 21 degrees Celsius."}])
    second = oai.responses.create(**follow_up)
    events = list(oai.responses.create(**follow_up, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the stored turn came first
