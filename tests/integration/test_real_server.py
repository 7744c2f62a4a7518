"""The server on the real pair: concurrent greedy streams, verified together in batched forwards,
give exactly the text each request gets alone (exact mode)."""
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Name three prime numbers and explain why they are prime.",
    "Translate to English: Der Hund schläft im Garten.",
    "What is the capital of Australia?",
]


def test_concurrent_streams_equal_single_requests(real_engine):
    app = create_app(real_engine, ServerConfig(served_model_name="qwen", spec=SpecConfig("draft", 3)))
    with serve_in_thread(app, timeout=60) as (base_url, _):
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(prompt: str, method: str) -> str:
            stream = client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0,
                stream=True, extra_body={"speculative_decoding": {"method": method, "num_speculative_tokens": 3}},
            )
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

        alone = [ask(p, "off") for p in PROMPTS]
        for method in ("ngram", "draft"):
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                together = list(pool.map(lambda p: ask(p, method), PROMPTS))
            assert together == alone, method
        assert all(alone)
