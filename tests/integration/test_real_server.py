"""The server on the real pair: concurrent streams, verified together in batched forwards and
queued for a slot when there are more of them than slots, give exactly the text each request gets
alone — greedy for every method, and seeded sampling for the methods whose seeded text is plain
decoding's (off, ngram, and auto while it proposes no draft-model tokens)."""
import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fakes.load import LoadRequest, client_session, send, used_the_draft_model
from openai import OpenAI

from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

# A hang fails fast, with every thread's traceback (the worker may be stuck inside llama.cpp).
pytestmark = pytest.mark.timeout(600, method="thread")
START_TIMEOUT = 300  # seconds: the server's start-up calibrates `auto` (about 10 s on an idle machine)
# These tests check texts, not stalls: a generous stall limit, so that a starved run (a shared
# machine, `nice`) is not cut by the watchdog (tests/unit/test_server_faults.py tests it).
STALL_TIMEOUT = 1800

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Name three prime numbers and explain why they are prime.",
    "Translate to English: Der Hund schläft im Garten.",
    "What is the capital of Australia?",
]


def test_concurrent_streams_equal_single_requests(real_engine):
    app = create_app(real_engine, ServerConfig(served_model_name="qwen", spec=SpecConfig("draft", 3),
                                               stall_timeout=STALL_TIMEOUT))
    with serve_in_thread(app, timeout=START_TIMEOUT) as (base_url, _):
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(prompt: str, method: str) -> str:
            stream = client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0,
                stream=True, extra_body={"speculative_decoding": {"method": method, "num_speculative_tokens": 3}},
            )
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

        alone = [ask(p, "off") for p in PROMPTS]
        for method in ("off", "ngram", "draft"):  # off too: plain decoding's streams share forwards
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                together = list(pool.map(lambda p: ask(p, method), PROMPTS))
            assert together == alone, method
        assert all(alone)


MIXED = [  # (prompt, method, temperature, seed): more streams than the 4 slots, auto the most
    ("Write a Python function that reverses a linked list.", "auto", 0.0, None),
    ("Name three prime numbers and explain why they are prime.", "auto", 0.7, 11),
    ("Translate to English: Der Hund schläft im Garten.", "auto", 0.0, None),
    ("What is the capital of Australia?", "auto", 0.7, 12),
    ("Explain what a hash map is in one paragraph.", "ngram", 0.7, 13),
    ("def fibonacci(n):", "off", 0.7, 14),
    ("List the planets of the solar system.", "draft", 0.0, None),
    ("Write a haiku about compilers.", "auto", 0.7, 15),
    ("What does HTTP 429 mean?", "ngram", 0.0, None),
    ("Sort [3, 1, 2] in Python.", "auto", 0.0, None),
]
MAX_TOKENS = 24


def test_more_streams_than_slots_with_auto_and_seeded_sampling_equal_each_request_alone(real_engine, record_property):
    """10 streams against 4 slots and a queue of 4: two are refused (429) and come back after
    Retry-After, four wait for a slot; each text equals the same request sent alone."""
    requests = [LoadRequest(prompt, MAX_TOKENS, method, temperature, seed, api_key=f"key-{i % 3}")
                for i, (prompt, method, temperature, seed) in enumerate(MIXED)]
    config = ServerConfig(served_model_name="qwen", spec=SpecConfig("auto", 3), max_queue=4,
                          stall_timeout=STALL_TIMEOUT)
    app = create_app(real_engine, config)
    with serve_in_thread(app, timeout=START_TIMEOUT) as (url, _):
        async def alone():
            async with client_session() as http:
                return [await send(http, url, "qwen", request) for request in requests]

        async def together():
            async def until_accepted(http, request):
                refusals = 0
                while True:
                    outcome = await send(http, url, "qwen", request)
                    if outcome.status != 429:
                        return outcome, refusals
                    refusals += 1
                    await asyncio.sleep(outcome.retry_after)

            async with client_session() as http:
                return await asyncio.gather(*(until_accepted(http, request) for request in requests))

        single = asyncio.run(alone())
        concurrent = asyncio.run(together())

    compared = unchecked = 0
    for request, first, (second, _) in zip(requests, single, concurrent):
        assert first.status == second.status == 200 and first.problem is None and second.problem is None, \
            (request, first.problem, second.problem)
        assert first.text and first.completion_tokens > 0
        if request.temperature > 0 and (used_the_draft_model(first.choices) or used_the_draft_model(second.choices)):
            unchecked += 1  # auto sampled with the draft model: equally likely, not the same text (docs/usage.md, Sampling)
            continue
        assert second.text == first.text, request
        assert second.completion_tokens == first.completion_tokens
        compared += 1
    refused = sum(refusals for _, refusals in concurrent)
    record_property("real_server_mixed", json.dumps({"compared": compared, "unchecked": unchecked, "429s": refused}))
    print(f"\nreal pair, mixed: {compared} texts compared, {unchecked} sampled by auto with the draft model, "
          f"{refused} refusals (429) before acceptance")
    assert refused > 0  # the queue was full for some of them


FIM_PREFIX = 'def is_palindrome(text: str) -> bool:\n    """Whether text reads the same backwards, ignoring case and spaces."""\n'
FIM_SUFFIX = '\n\n\nprint(is_palindrome("Never odd or even"))\n'


def test_fim_body_is_the_same_under_off_and_auto(real_engine):
    """A function body cut out, asked back through `/v1/completions` with a suffix and through
    `/infill`: greedy, `auto` writes exactly `off`'s body, ended by the model's end token."""
    app = create_app(real_engine, ServerConfig(served_model_name="qwen", spec=SpecConfig("auto", 3),
                                               stall_timeout=STALL_TIMEOUT))
    answers = {}
    with serve_in_thread(app, timeout=START_TIMEOUT) as (url, _):
        for method in ("off", "auto"):
            spec = {"method": method}
            completion = httpx.post(f"{url}/v1/completions", timeout=600, json={
                "model": "qwen", "prompt": FIM_PREFIX, "suffix": FIM_SUFFIX, "max_tokens": 64, "temperature": 0,
                "speculative_decoding": spec}).json()
            infill = httpx.post(f"{url}/infill", timeout=600, json={
                "input_prefix": FIM_PREFIX, "input_suffix": FIM_SUFFIX, "n_predict": 64, "temperature": 0,
                "speculative_decoding": spec}).json()
            answers[method] = (completion["choices"][0]["text"], completion["choices"][0]["finish_reason"],
                               infill["content"], infill["stop_type"])
    assert answers["auto"] == answers["off"]
    text, finish_reason, content, stop_type = answers["off"]
    assert "return" in text and finish_reason == "stop" and "print(" not in text, text
    assert "return" in content and stop_type == "eos" and "print(" not in content, content


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def test_openai_client_streams_a_required_tool_call(real_engine):
    """tool_choice "required": the grammar makes Qwen2.5 write one `<tool_call>` block (it answers
    this prompt with a markdown JSON block under "auto"); streamed, the `openai` client assembles
    the call; `auto` streams exactly what `off` returns whole."""
    app = create_app(real_engine, ServerConfig(served_model_name="qwen", spec=SpecConfig("auto", 3),
                                               stall_timeout=STALL_TIMEOUT))
    with serve_in_thread(app, timeout=START_TIMEOUT) as (url, _):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        request = dict(model="qwen", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice="required",
                       parallel_tool_calls=False, temperature=0, max_tokens=64)
        with client.chat.completions.stream(**request) as stream:
            streamed = stream.get_final_completion().choices[0]
        whole = client.chat.completions.create(**request, extra_body={"speculative_decoding": {"method": "off"}})
    assert streamed.finish_reason == "tool_calls" == whole.choices[0].finish_reason
    (call,) = streamed.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert "Paris" in arguments["city"] and arguments.get("unit", "celsius") in ("celsius", "fahrenheit")
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == [
        (call.function.name, call.function.arguments)]


def test_langchain_tools_and_structured_output(real_engine):
    """langchain-openai's ChatOpenAI against the server: bind_tools gets a tool call back, and
    with_structured_output fills a Pydantic model by a forced tool call and by response_format."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Get the current weather in a city."""

        city: str = Field(description="The city name")

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str
        age: int

    app = create_app(real_engine, ServerConfig(served_model_name="qwen", spec=SpecConfig("auto", 3),
                                               stall_timeout=STALL_TIMEOUT))
    with serve_in_thread(app, timeout=START_TIMEOUT) as (url, _):
        llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="qwen", temperature=0, max_tokens=64,
                         max_retries=0, timeout=600)
        message = llm.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False).invoke(
            "What's the weather like in Paris right now?")
        people = [llm.with_structured_output(Person, method=method).invoke("Alice is 30 years old.")
                  for method in ("function_calling", "json_schema")]
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [("GetWeather", {"city": "Paris"})]
    assert people == [Person(name="Alice", age=30)] * 2
