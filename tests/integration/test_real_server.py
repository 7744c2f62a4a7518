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
            unchecked += 1  # auto sampled with the draft model: equally likely, not the same text (README)
            continue
        assert second.text == first.text, request
        assert second.completion_tokens == first.completion_tokens
        compared += 1
    refused = sum(refusals for _, refusals in concurrent)
    record_property("real_server_mixed", json.dumps({"compared": compared, "unchecked": unchecked, "429s": refused}))
    print(f"\nreal pair, mixed: {compared} texts compared, {unchecked} sampled by auto with the draft model, "
          f"{refused} refusals (429) before acceptance")
    assert refused > 0  # the queue was full for some of them
