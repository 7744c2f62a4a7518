"""A load generator for the server: many concurrent streaming chat clients, each checking every
answer it gets. Shared by the load test (tests/unit/test_server_load.py) and the soaks
(scripts/soak_server.py, scripts/soak_isolation.py).

Each request is a streaming chat completion with `stream_options.include_usage`: greedy or seeded
sampling, one of the speculative methods, one of several API keys. A 200 must be one well-formed
stream — a role chunk, text chunks, exactly one finish_reason chunk, the usage chunk, one
`[DONE]`, one id throughout — whose text and token count equal `expected(request)`; a 429 must be
OpenAI-shaped `queue_full` with a Retry-After, which the client then waits out. Anything else is
recorded as a failure. The generator records; the caller decides what to assert. A request may
also ask for one JSON answer (`stream=False`), checked for its text and usage alike.
"""
from __future__ import annotations

import asyncio
import functools
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

PROMPTS = ["the cat sat on the mat", "abc abc abc", "hello wörld", "x", "the the the cat", "on the mat on the",
           "sat sat", "mat cat", "Write quicksort.", "cat on a mat, again and again"]


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_tokens: int
    method: str
    temperature: float = 0.0
    seed: Optional[int] = None
    api_key: str = "key-0"
    disconnect_after: Optional[int] = None  # chunks read before the client hangs up on purpose
    stream: bool = True  # False: one JSON answer

    def body(self, model: str) -> dict:
        body = {"model": model, "messages": [{"role": "user", "content": self.prompt}], "max_tokens": self.max_tokens,
                "temperature": self.temperature, "stream": self.stream,
                "speculative_decoding": {"method": self.method}}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.seed is not None:
            body["seed"] = self.seed
            body["top_p"] = 0.95
        return body


@dataclass(frozen=True)
class Expected:
    text: str
    completion_tokens: int
    finish_reason: str


@dataclass
class Outcome:
    request: LoadRequest
    status: Optional[int] = None  # None: no HTTP answer at all (a transport error)
    problem: Optional[str] = None  # what was wrong with the answer; None if it was right
    disconnected: bool = False  # the client hung up on purpose
    latency: float = 0.0  # seconds, request sent -> [DONE]
    ttft: Optional[float] = None
    completion_tokens: int = 0
    choices: dict = field(default_factory=dict)  # what the speculative method proposed
    retry_after: float = 0.0  # seconds, from a 429's Retry-After
    text: str = ""  # of a whole answer


def make_request(rng: random.Random, api_keys: int = 8, disconnect_rate: float = 0.0,
                 max_tokens: tuple[int, ...] = (8, 16, 32, 48),
                 greedy_methods: tuple[str, ...] = ("off", "ngram", "draft", "auto"),
                 sampled_methods: tuple[str, ...] = ("off", "ngram", "auto"), key_skew: float = 0.0) -> LoadRequest:
    """A random request: half greedy (any method), half seeded sampling (methods whose seeded
    text equals plain decoding's: docs/usage.md, Sampling). API key i is drawn with weight 1/(i+1)**key_skew
    (0: uniformly; 1: a few keys send most requests, as real tenants do)."""
    greedy = rng.random() < 0.5
    key = rng.choices(range(api_keys), weights=[1 / (i + 1) ** key_skew for i in range(api_keys)])[0]
    return LoadRequest(
        prompt=rng.choice(PROMPTS),
        max_tokens=rng.choice(max_tokens),
        method=rng.choice(greedy_methods if greedy else sampled_methods),
        temperature=0.0 if greedy else 0.8,
        seed=None if greedy else rng.randrange(1000),
        api_key=f"key-{key}",
        disconnect_after=rng.choice((1, 3)) if rng.random() < disconnect_rate else None,
    )


@functools.lru_cache(maxsize=4096)
def _fake_expected(prompt: str, max_tokens: int, temperature: float, seed: Optional[int]) -> Expected:
    from specdec.backends.fake import FakeBackend
    from specdec.engine.engine import Engine
    from specdec.types import GenerationRequest, SamplingParams, SpecConfig

    engine = Engine(FakeBackend(seed=7))
    ids = engine.encode_prompt([{"role": "user", "content": prompt}], chat=True)
    sampling = SamplingParams(temperature=temperature, top_p=0.95 if seed is not None else 1.0, seed=seed)
    result = engine.generate(GenerationRequest(tuple(ids), max_tokens, sampling, SpecConfig("off", 0)))
    return Expected(result.text, len(result.token_ids), result.finish_reason)


def fake_expected(request: LoadRequest) -> Expected:
    """What the fake engine (tests/fakes/fake_serve.py's) generates for the request alone: plain
    decoding, no server."""
    return _fake_expected(request.prompt, request.max_tokens, request.temperature, request.seed)


def used_the_draft_model(choices: dict) -> bool:
    """Rounds drafted by the draft model (or a hybrid): a seeded sampled text then legitimately
    differs from plain decoding's (docs/usage.md, Sampling), so it cannot be checked against it."""
    return any(choice.startswith(("draft", "hybrid")) for choice in choices)


async def send(client: httpx.AsyncClient, url: str, model: str, request: LoadRequest,
               expected: Optional[Callable[[LoadRequest], Expected]] = None) -> Outcome:
    """One request, its answer checked (its text against `expected`, if given)."""
    outcome = Outcome(request)
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {request.api_key}"}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=request.body(model),
                                 headers=headers) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                outcome.problem = _refusal_problem(response)
                if outcome.problem is None:
                    outcome.retry_after = float(response.headers["retry-after"])
                return outcome
            if not request.stream:
                await response.aread()
                outcome.latency = time.monotonic() - started
                outcome.problem = _answer_problem(response, request, expected, outcome)
                return outcome
            lines = []
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line[len("data: "):])
                if outcome.ttft is None and '"content":"' in line and '"content":""' not in line:
                    outcome.ttft = time.monotonic() - started
                if request.disconnect_after is not None and len(lines) >= request.disconnect_after:
                    outcome.disconnected = True
                    return outcome  # leaving the block closes the connection mid-stream
            outcome.latency = time.monotonic() - started
            # Off the event loop: a long reference would hold up every other client's stream.
            outcome.problem = await asyncio.to_thread(_stream_problem, lines, request, expected, outcome)
    except httpx.HTTPError as exc:
        outcome.problem = f"transport error: {exc!r}"
    return outcome


def _refusal_problem(response: httpx.Response) -> Optional[str]:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} without an OpenAI error body"
    if set(error) != {"message", "type", "param", "code"}:
        return f"{response.status_code} with a malformed error: {error}"
    if response.status_code != 429:
        return f"unexpected {response.status_code}: {error}"
    if error["code"] != "queue_full" or not response.headers.get("retry-after", "").isdigit():
        return f"a 429 without queue_full and Retry-After: {error}, {dict(response.headers)}"
    return None


def _answer_problem(response: httpx.Response, request: LoadRequest,
                    expected: Optional[Callable[[LoadRequest], Expected]], outcome: Outcome) -> Optional[str]:
    """What is wrong with a 200 that is not streamed (None: nothing)."""
    try:
        answer = response.json()
        choice, usage = answer["choices"][0], answer["usage"]
        text, finish = choice["message"]["content"] or "", choice["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"a malformed answer ({exc!r}): {response.text[:200]}"
    return _text_problem(text, usage, finish, request, expected, outcome)


def _stream_problem(lines: list[str], request: LoadRequest,
                    expected: Optional[Callable[[LoadRequest], Expected]], outcome: Outcome) -> Optional[str]:
    if not lines or lines[-1] != "[DONE]" or lines.count("[DONE]") != 1:
        return f"the stream does not end in one [DONE]: {lines[-3:]}"
    chunks = [json.loads(line) for line in lines[:-1]]
    if any("error" in chunk for chunk in chunks):
        return f"an error event: {chunks[-1]}"
    if len({chunk["id"] for chunk in chunks}) != 1:
        return "chunks with different ids"
    if chunks[0]["choices"][0]["delta"].get("role") != "assistant":
        return "no role chunk first"
    usage_chunk = chunks[-1]
    if usage_chunk["choices"] or not usage_chunk.get("usage"):
        return "no usage chunk last"
    finals = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    if len(finals) != 1 or chunks[-2]["choices"][0]["finish_reason"] is None:
        return f"{len(finals)} finish_reason chunks"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    return _text_problem(text, usage_chunk["usage"], finals[0], request, expected, outcome)


def _text_problem(text: str, usage: dict, finish: str, request: LoadRequest,
                  expected: Optional[Callable[[LoadRequest], Expected]], outcome: Outcome) -> Optional[str]:
    """Records a well-formed answer's text and usage; what is wrong with them against `expected`."""
    outcome.completion_tokens = usage["completion_tokens"]
    outcome.choices = (usage.get("speculative") or {}).get("choices", {})
    outcome.text = text
    if expected is None or (request.temperature > 0 and used_the_draft_model(outcome.choices)):
        return None  # well formed; a sampled text drafted by the model is a sample, not a fixed text
    want = expected(request)
    if text != want.text:
        return f"wrong text: {text!r} != {want.text!r}"
    if usage["completion_tokens"] != want.completion_tokens or finish != want.finish_reason:
        return f"wrong usage or finish: {usage['completion_tokens']}, {finish} != {want}"
    return None


# A client must drop an idle connection before the server does (uvicorn: after 5 s), or a request
# sent just as the server closes it is lost to a connection reset (a soak on a starved machine hit
# it twice in 4,000 requests with httpx's default of 5 s, the same as the server's).
CLIENT_KEEPALIVE_SECONDS = 2.0


def client_session(timeout: float = 600) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30),
                             limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_SECONDS))


@dataclass
class LoadReport:
    outcomes: list[Outcome]
    seconds: float

    def count(self, predicate) -> int:
        return sum(1 for outcome in self.outcomes if predicate(outcome))

    @property
    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200 and not o.disconnected and o.problem is None]

    def summary(self) -> dict:
        latencies = sorted(o.latency for o in self.completed)
        ttfts = sorted(o.ttft for o in self.completed if o.ttft is not None)
        return {
            "seconds": round(self.seconds, 1),
            "requests": len(self.outcomes),
            "completed": len(self.completed),
            "rejected_429": self.count(lambda o: o.status == 429),
            "disconnected_on_purpose": self.count(lambda o: o.disconnected),
            "server_errors_5xx": self.count(lambda o: o.status is not None and o.status >= 500),
            "lost": self.count(lambda o: o.status is None),
            "wrong": self.count(lambda o: o.problem is not None),
            "sampled_with_draft_model_unchecked": self.count(
                lambda o: o.status == 200 and o.request.temperature > 0 and used_the_draft_model(o.choices)),
            "completion_tokens": sum(o.completion_tokens for o in self.completed),
            "latency_p50_s": _percentile(latencies, 50),
            "latency_p95_s": _percentile(latencies, 95),
            "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p95_s": _percentile(ttfts, 95),
        }

    def problems(self, limit: int = 5) -> list[str]:
        return [f"{o.request}: {o.problem}" for o in self.outcomes if o.problem is not None][:limit]


def _percentile(values: list[float], q: int) -> Optional[float]:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


async def run_load(url: str, model: str, expected: Callable[[LoadRequest], Expected], *, clients: int,
                   seconds: Optional[float] = None, total_requests: Optional[int] = None, seed: int = 0,
                   **request_options) -> LoadReport:
    """`clients` concurrent clients send requests back to back (waiting out each 429's
    Retry-After) until `seconds` have passed or `total_requests` have been sent."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    issued = 0

    def more() -> bool:
        nonlocal issued
        if seconds is not None and time.monotonic() - started >= seconds:
            return False
        if total_requests is not None and issued >= total_requests:
            return False
        issued += 1
        return True

    async def client(client_rng: random.Random) -> None:
        async with client_session() as http:
            while more():
                outcome = await send(http, url, model, make_request(client_rng, **request_options), expected)
                outcomes.append(outcome)
                if outcome.status == 429:
                    await asyncio.sleep(outcome.retry_after)

    await asyncio.gather(*(client(random.Random(rng.random())) for _ in range(clients)))
    return LoadReport(outcomes, time.monotonic() - started)
