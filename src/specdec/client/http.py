"""Sync and async clients for OpenAI-compatible endpoints (specdec's server or any other), on httpx.

One request is a series of attempts. An attempt that fails with 429, a 5xx, a connection error, a
dropped stream or a timeout is retried after an exponential backoff with jitter, or after the
server's `Retry-After` when it sends one (never sooner), up to `RetryPolicy.max_attempts`. Any
other 4xx is final at once. Every attempt is recorded (`Attempt`) on the result and on the raised
error, so a caller can always say what happened.

Timeouts scale with the work asked for: connect + first-token allowance + per-token allowance ×
max_tokens (`Timeouts`), or a fixed total when one is given.

The retry and stream logic is written once, as plans free of I/O that `Client`'s blocking and
`AsyncClient`'s asyncio transport each run (see "the retry and stream logic" below).

Errors are typed (`BadRequestError`, `RateLimitError`, `InternalServerError`, `APIConnectionError`,
`APITimeoutError`, ...) and carry the server's OpenAI error message, type, param and code.
"""
from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import random
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable, Generator, Iterator, Mapping, Optional, Union

import httpx

from specdec.types import SpecdecError

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}


# -- errors ------------------------------------------------------------------------------------------

class APIError(SpecdecError):
    """A request that did not succeed. `attempts` holds every attempt made (filled when we give up)."""

    retryable = False

    def __init__(self, message: str, *, status_code: Optional[int] = None, type: Optional[str] = None,
                 param: Optional[str] = None, code: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.attempts: tuple[Attempt, ...] = ()

    def __str__(self) -> str:
        head = f"HTTP {self.status_code}" if self.status_code is not None else self.__class__.__name__
        kind = f" {self.type}" if self.type else ""
        param = f" (param: {self.param})" if self.param else ""
        return f"{head}{kind}: {self.message}{param}"


class APIStatusError(APIError):
    """The server answered with an error status."""


class BadRequestError(APIStatusError):  # 400, 422 and other 4xx without their own class
    pass


class AuthenticationError(APIStatusError):  # 401
    pass


class PermissionDeniedError(APIStatusError):  # 403
    pass


class NotFoundError(APIStatusError):  # 404
    pass


class RateLimitError(APIStatusError):  # 429
    retryable = True


class InternalServerError(APIStatusError):  # 5xx
    retryable = True


class APIConnectionError(APIError):
    """No complete answer: connection refused or reset, or a stream cut before `data: [DONE]`."""

    retryable = True


class APITimeoutError(APIConnectionError):
    pass


class APIResponseError(APIError):
    """A 2xx answer we cannot read (not JSON, no choices)."""


_STATUS_CLASSES = {401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError, 429: RateLimitError}


def parse_retry_after(headers: Mapping[str, str], now: Optional[float] = None) -> Optional[float]:
    """Seconds the server asks us to wait: `retry-after-ms`, `Retry-After` in seconds (fractions
    accepted) or as an HTTP date. None when absent or unreadable."""
    value = headers.get("retry-after-ms")
    if value is not None:
        with contextlib.suppress(ValueError):
            return max(0.0, float(value) / 1000.0)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def status_error(status_code: int, content: bytes, headers: Mapping[str, str]) -> APIStatusError:
    """The typed error for an error response, with the OpenAI `error` object's fields when present."""
    error: dict = {}
    try:
        body = json.loads(content)
        if isinstance(body, dict):
            error = body.get("error") if isinstance(body.get("error"), dict) else {}
            if not error and isinstance(body.get("detail"), str):  # plain FastAPI errors
                error = {"message": body["detail"]}
    except ValueError:
        pass
    message = str(error.get("message") or content.decode("utf-8", "replace").strip()[:500] or "no message")
    if status_code >= 500:
        cls = InternalServerError
    else:
        cls = _STATUS_CLASSES.get(status_code, BadRequestError)
    return cls(message, status_code=status_code, type=error.get("type"), param=error.get("param"),
               code=None if error.get("code") is None else str(error.get("code")),
               retry_after=parse_retry_after(headers))


@contextlib.contextmanager
def _transport_errors() -> Iterator[None]:
    """httpx's transport failures as our typed errors (works around sync and async code alike)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise APITimeoutError(f"timed out ({exc.__class__.__name__})") from exc
    except httpx.TransportError as exc:
        raise APIConnectionError(f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__) from exc


# -- policy ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timeouts:
    """How long a request may take: `connect` to open the connection, then `first_token` (queueing
    and prompt processing) plus `per_token` × max_tokens for the whole answer. `total` replaces the
    scaled budget with a fixed one. A request without max_tokens is budgeted at `default_max_tokens`.

    Example: the defaults with max_tokens=128 give 10 + 30 + 0.5 × 128 = 104 seconds.
    """

    connect: float = 10.0
    first_token: float = 30.0
    per_token: float = 0.5
    total: Optional[float] = None
    default_max_tokens: int = 1024

    def request_seconds(self, max_tokens: Optional[int]) -> float:
        if self.total is not None:
            return self.total
        tokens = self.default_max_tokens if max_tokens is None else max_tokens
        return self.connect + self.first_token + self.per_token * tokens


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and jitter.

    Before attempt n + 1 we wait `backoff_base × 2^(n-1)` (capped at `backoff_max`), scaled by a
    random factor in [0.5, 1) so that many clients do not come back together; when the server sent
    `Retry-After` we wait that long plus up to 10 % (never less). A `Retry-After` beyond
    `max_retry_after` ends the retries instead of being shortened.

    Example: base 0.5 → waits in [0.25, 0.5), [0.5, 1), [1, 2), ... ; Retry-After: 2 → [2, 2.2).
    """

    max_attempts: int = 5
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    max_retry_after: float = 120.0

    def delay(self, attempt: int, retry_after: Optional[float], rng: random.Random) -> Optional[float]:
        """Seconds to wait after failed attempt number `attempt` (1-based); None = stop retrying."""
        if attempt >= self.max_attempts:
            return None
        if retry_after is not None:
            if retry_after > self.max_retry_after:
                return None
            return retry_after * (1.0 + 0.1 * rng.random())
        ceiling = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1))
        return ceiling * (0.5 + 0.5 * rng.random())


@dataclass(frozen=True)
class Attempt:
    """One try of a request. `error` is None on the attempt that succeeded; `wait_seconds` is the
    backoff slept after this attempt (None when no retry followed)."""

    number: int
    elapsed_seconds: float
    status_code: Optional[int] = None
    error: Optional[str] = None
    retry_after: Optional[float] = None
    wait_seconds: Optional[float] = None

    def as_dict(self) -> dict:
        return {"number": self.number, "elapsed_seconds": round(self.elapsed_seconds, 6),
                "status_code": self.status_code, "error": self.error,
                "retry_after": self.retry_after,
                "wait_seconds": None if self.wait_seconds is None else round(self.wait_seconds, 6)}


@dataclass(frozen=True)
class Completion:
    """A finished request. Latency and time to first token are those of the successful attempt
    (ttft only when streamed); `attempts` lists every attempt, failed ones first."""

    text: str
    finish_reason: Optional[str]
    usage: Optional[dict]
    model: Optional[str]
    latency_seconds: float
    ttft_seconds: Optional[float]
    attempts: tuple[Attempt, ...] = ()


def speculative_decoding_field(setting: str) -> Union[bool, dict]:
    """The request's `speculative_decoding` value for a user setting: on → true, off → false, and a
    method name (auto, ngram, draft, ...) → {"method": name}."""
    if setting == "on":
        return True
    if setting == "off":
        return False
    return {"method": setting}


# -- shared machinery -----------------------------------------------------------------------------

class _AttemptLog:
    """Records attempts and decides, per failure, whether and how long to wait before the next."""

    def __init__(self, policy: RetryPolicy, rng: random.Random, clock: Callable[[], float]):
        self.policy, self.rng, self.clock = policy, rng, clock
        self.attempts: list[Attempt] = []
        self.started = 0.0

    def start(self) -> float:
        self.started = self.clock()
        return self.started

    def failed(self, exc: APIError, *, final: bool = False) -> float:
        """The wait before the next attempt; raises `exc` (with every attempt) when there is none."""
        number = len(self.attempts) + 1
        delay = None if final or not exc.retryable else self.policy.delay(number, exc.retry_after, self.rng)
        self.attempts.append(Attempt(number, self.clock() - self.started, exc.status_code, str(exc),
                                     exc.retry_after, delay))
        if delay is None:
            exc.attempts = tuple(self.attempts)
            raise exc
        return delay

    def succeeded(self, status_code: int) -> tuple[Attempt, ...]:
        self.attempts.append(Attempt(len(self.attempts) + 1, self.clock() - self.started, status_code))
        return tuple(self.attempts)


def _choice(body: dict) -> dict:
    choices = body.get("choices") or []
    return choices[0] if choices and isinstance(choices[0], dict) else {}


def _choice_text(endpoint: str, choice: dict, *, delta: bool) -> str:
    if endpoint == "chat":
        part = choice.get("delta" if delta else "message") or {}
        return part.get("content") or ""
    return choice.get("text") or ""


class _StreamState:
    """Folds the SSE lines of one streamed attempt into text, usage and timings."""

    def __init__(self, endpoint: str, clock: Callable[[], float], started: float, deadline: float):
        self.endpoint, self.clock, self.started, self.deadline = endpoint, clock, started, deadline
        self.parts: list[str] = []
        self.usage: Optional[dict] = None
        self.model: Optional[str] = None
        self.finish_reason: Optional[str] = None
        self.ttft: Optional[float] = None
        self.done = False

    def feed(self, line: str) -> Optional[str]:
        """The text delta carried by one line, if any. Raises on an error event or past the deadline."""
        if self.clock() > self.deadline:
            raise APITimeoutError(f"stream exceeded its {self.deadline - self.started:.1f}s budget")
        if not line.startswith("data:"):
            return None  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise APIResponseError(f"unreadable stream event: {data[:200]!r}") from exc
        if isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            raise InternalServerError(str(error.get("message") or "error event in stream"), type=error.get("type"),
                                      code=None if error.get("code") is None else str(error.get("code")))
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choice = _choice(chunk)
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        text = _choice_text(self.endpoint, choice, delta=True)
        if not text:
            return None
        if self.ttft is None:
            self.ttft = self.clock() - self.started
        self.parts.append(text)
        return text

    def finish(self) -> None:
        if not self.done:
            raise APIConnectionError("stream ended before data: [DONE]")

    def completion(self, attempts: tuple[Attempt, ...]) -> Completion:
        return Completion("".join(self.parts), self.finish_reason, self.usage, self.model,
                          self.clock() - self.started, self.ttft, attempts)


def _parse_completion(endpoint: str, response: httpx.Response, latency: float) -> Completion:
    try:
        body = response.json()
    except ValueError as exc:
        raise APIResponseError(f"response is not JSON: {response.text[:200]!r}") from exc
    choice = _choice(body)
    return Completion(_choice_text(endpoint, choice, delta=False), choice.get("finish_reason"), body.get("usage"),
                      body.get("model"), latency, None)


# -- the retry and stream logic, written once ---------------------------------------------------
# A plan is a generator holding one request's whole logic (attempts, retry decisions, SSE parsing)
# and no I/O: it yields steps, which a transport (Client's blocking one, AsyncClient's asyncio one)
# performs and answers with `send` (the response, bytes or a line) or fails with `throw` (an
# APIError); a _Delta is handed on to the caller, and what the plan returns is the result.

@dataclass(frozen=True)
class _Send:
    """Send a request; answered with the httpx.Response (streamed: its body not read yet)."""

    method: str
    url: str
    payload: Optional[dict]
    budget: float  # seconds
    stream: bool = False


@dataclass(frozen=True)
class _Wait:
    """Sleep before the next attempt; the transport closes the open response first."""

    seconds: float


@dataclass(frozen=True)
class _Delta:
    """A text delta for the caller of a stream."""

    text: str


class _ReadBody:
    """Read the open streamed response's whole body; answered with bytes."""


class _ReadLine:
    """Read the open streamed response's next line; answered with None at its end."""


READ_BODY, READ_LINE = _ReadBody(), _ReadLine()
Plan = Generator[Union[_Send, _Wait, _Delta, _ReadBody, _ReadLine], Any, Any]


class _ClientCore:
    """What the sync and async clients share: configuration, request shaping and every plan; a
    subclass adds its transport (`_drive`) and the public methods that wait on it."""

    _text_stream: Callable[[], Any]  # the subclass's stream holder class

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: Optional[str] = None, *,
                 retry: RetryPolicy = RetryPolicy(), timeouts: Timeouts = Timeouts(),
                 rng: Optional[random.Random] = None, clock: Callable[[], float] = time.monotonic):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.retry = retry
        self.timeouts = timeouts
        self.rng = rng or random.Random()
        self.clock = clock

    def _headers(self) -> dict:
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _prepare(self, endpoint: str, body: Mapping[str, Any], stream: bool) -> tuple[str, dict, float]:
        """URL, JSON payload and time budget (seconds) for one request."""
        if endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"unknown endpoint {endpoint!r}; use one of {sorted(ENDPOINT_PATHS)}")
        payload = dict(body)
        if stream:
            payload["stream"] = True
            payload.setdefault("stream_options", {"include_usage": True})
        else:
            payload.pop("stream", None)
            payload.pop("stream_options", None)
        max_tokens = payload.get("max_tokens", payload.get("max_completion_tokens"))
        return self.base_url + ENDPOINT_PATHS[endpoint], payload, self.timeouts.request_seconds(max_tokens)

    def _timeout(self, budget: float) -> httpx.Timeout:
        return httpx.Timeout(budget, connect=min(self.timeouts.connect, budget))

    def _log(self) -> _AttemptLog:
        return _AttemptLog(self.retry, self.rng, self.clock)

    def _call_plan(self, method: str, url: str, payload: Optional[dict], budget: float,
                   parse: Callable[[httpx.Response, float], Any]) -> Plan:
        """One non-streamed request with retries; returns (parse(response, latency), every attempt)."""
        log = self._log()
        while True:
            started = log.start()
            try:
                response = yield _Send(method, url, payload, budget)
                if response.status_code >= 400:
                    raise status_error(response.status_code, response.content, response.headers)
                result = parse(response, self.clock() - started)
            except APIResponseError as exc:
                log.failed(exc, final=True)
            except APIError as exc:
                yield _Wait(log.failed(exc))
            else:
                return result, log.succeeded(response.status_code)

    def _models_plan(self) -> Plan:
        """The model ids that `GET /models` lists, in the server's order."""
        budget = self.timeouts.connect + self.timeouts.first_token
        ids, _ = yield from self._call_plan("GET", self.base_url + "/models", None, budget,
                                            lambda response, _: _model_ids(response))
        return ids

    def _completion_plan(self, endpoint: str, body: Mapping[str, Any]) -> Plan:
        """One non-streamed chat or completions request; returns its Completion."""
        url, payload, budget = self._prepare(endpoint, body, stream=False)
        completion, attempts = yield from self._call_plan(
            "POST", url, payload, budget, lambda response, latency: _parse_completion(endpoint, response, latency))
        return replace(completion, attempts=attempts)

    def _stream_plan(self, endpoint: str, url: str, payload: dict, budget: float, restartable: bool) -> Plan:
        """One streamed request: yields its deltas, returns its Completion. An attempt cut before
        its first delta is retried; one cut after it only when `restartable` (nothing handed out
        is taken back: create(stream=True) collects, stream() hands out)."""
        log = self._log()
        while True:
            started = log.start()
            state = _StreamState(endpoint, self.clock, started, started + budget)
            try:
                response = yield _Send("POST", url, payload, budget, stream=True)
                if response.status_code >= 400:
                    raise status_error(response.status_code, (yield READ_BODY), response.headers)
                while (line := (yield READ_LINE)) is not None:
                    text = state.feed(line)
                    if text:
                        yield _Delta(text)
                state.finish()
            except APIResponseError as exc:
                log.failed(exc, final=True)
            except APIError as exc:
                yield _Wait(log.failed(exc, final=bool(state.parts) and not restartable))
                continue
            return state.completion(log.succeeded(response.status_code))

    def _stream(self, endpoint: str, body: Mapping[str, Any], *, restartable: bool):
        url, payload, budget = self._prepare(endpoint, body, stream=True)
        holder = self._text_stream()
        holder._deltas = self._drive(self._stream_plan(endpoint, url, payload, budget, restartable),
                                     lambda completion: setattr(holder, "completion", completion))
        return holder

    def _drive(self, plan: Plan, done: Callable[[Any], None]):
        """The subclass's transport: performs the plan's steps, yields its deltas, hands its result to `done`."""
        raise NotImplementedError

    def stream(self, endpoint: str, body: Mapping[str, Any]) -> Union[TextStream, AsyncTextStream]:
        """The deltas of one streamed request as they come: a TextStream from Client, an
        AsyncTextStream from AsyncClient."""
        return self._stream(endpoint, body, restartable=False)

    def stream_chat(self, body: Mapping[str, Any]) -> Union[TextStream, AsyncTextStream]:
        return self.stream("chat", body)

    def stream_completions(self, body: Mapping[str, Any]) -> Union[TextStream, AsyncTextStream]:
        return self.stream("completions", body)


def request_fields(max_tokens: Optional[int] = None, temperature: Optional[float] = None,
                   speculative: Optional[str] = None) -> dict:
    """The generation fields that are set (None = leave it to the server); `speculative` is a user
    setting (on, off or a method name)."""
    fields: dict[str, Any] = {}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if temperature is not None:
        fields["temperature"] = temperature
    if speculative is not None:
        fields["speculative_decoding"] = speculative_decoding_field(speculative)
    return fields


def chat_body(messages: list, model: str, *, max_tokens: Optional[int] = None, temperature: Optional[float] = None,
              speculative: Optional[str] = None, extra: Optional[Mapping[str, Any]] = None) -> dict:
    """A chat request body; `extra` adds any other OpenAI fields (stop, seed, top_p, ...)."""
    return {"model": model, "messages": messages, **request_fields(max_tokens, temperature, speculative), **(extra or {})}


def completion_body(prompt: str, model: str, *, max_tokens: Optional[int] = None,
                    temperature: Optional[float] = None, speculative: Optional[str] = None,
                    extra: Optional[Mapping[str, Any]] = None) -> dict:
    return {"model": model, "prompt": prompt, **request_fields(max_tokens, temperature, speculative), **(extra or {})}


# -- sync ---------------------------------------------------------------------------------------------

class TextStream:
    """The text deltas of one streamed completion, in order. Once exhausted, `completion` holds the
    whole result (text, usage with the speculative block, ttft, attempts). Attempts are retried
    only until the first delta has been handed out; a stream cut after that raises."""

    def __init__(self) -> None:
        self.completion: Optional[Completion] = None
        self._deltas: Iterator[str] = iter(())

    def __iter__(self) -> Iterator[str]:
        return self._deltas


class Client(_ClientCore):
    """Blocking client. `sleep` and `clock` are injectable so tests never wait for real backoff."""

    _text_stream = TextStream

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: Optional[str] = None, *,
                 retry: RetryPolicy = RetryPolicy(), timeouts: Timeouts = Timeouts(),
                 rng: Optional[random.Random] = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, http: Optional[httpx.Client] = None):
        super().__init__(base_url, api_key, retry=retry, timeouts=timeouts, rng=rng, clock=clock)
        self.sleep = sleep
        self.http = http or httpx.Client()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def models(self) -> list[str]:
        """The model ids that `GET /models` lists, in the server's order."""
        return self._run(self._models_plan())

    def create(self, endpoint: str, body: Mapping[str, Any], *, stream: bool = False) -> Completion:
        """One chat ("chat") or completions ("completions") request, retried as the policy allows.
        With stream=True the answer is read as SSE (which gives ttft) and a stream cut midway is
        retried from the start."""
        if stream:
            text_stream = self._stream(endpoint, body, restartable=True)
            for _ in text_stream:
                pass
            return text_stream.completion
        return self._run(self._completion_plan(endpoint, body))

    def chat(self, body: Mapping[str, Any], *, stream: bool = False) -> Completion:
        """POST /chat/completions; build `body` with chat_body()."""
        return self.create("chat", body, stream=stream)

    def completions(self, body: Mapping[str, Any], *, stream: bool = False) -> Completion:
        """POST /completions; build `body` with completion_body()."""
        return self.create("completions", body, stream=stream)

    def _run(self, plan: Plan) -> Any:
        result: list = []
        for _ in self._drive(plan, result.append):
            pass
        return result[0]

    def _drive(self, plan: Plan, done: Callable[[Any], None]) -> Iterator[str]:
        """The blocking transport (see _ClientCore._drive)."""
        with contextlib.ExitStack() as open_response:
            reply: Any = None
            error: Optional[APIError] = None
            response: Any = None  # the attempt's streamed response, open until the next _Send or _Wait
            lines: Iterator[str] = iter(())
            try:
                while True:
                    try:
                        step = plan.send(reply) if error is None else plan.throw(error)
                    except StopIteration as stop:
                        done(stop.value)
                        return
                    reply, error = None, None
                    if isinstance(step, _Delta):
                        yield step.text
                        continue
                    if not isinstance(step, (_ReadBody, _ReadLine)):
                        open_response.close()  # an attempt's response is closed before anything else happens
                    if isinstance(step, _Wait):
                        self.sleep(step.seconds)
                        continue
                    try:
                        with _transport_errors():
                            if isinstance(step, _ReadLine):
                                reply = next(lines, None)
                            elif isinstance(step, _ReadBody):
                                reply = response.read()
                            elif step.stream:
                                response = reply = open_response.enter_context(self.http.stream(
                                    step.method, step.url, json=step.payload, headers=self._headers(),
                                    timeout=self._timeout(step.budget)))
                                lines = response.iter_lines()
                            else:
                                reply = self.http.request(step.method, step.url, json=step.payload,
                                                          headers=self._headers(), timeout=self._timeout(step.budget))
                    except APIError as exc:
                        error = exc
            finally:
                plan.close()


# -- async --------------------------------------------------------------------------------------------

class AsyncTextStream:
    """The async twin of TextStream: `async for delta in stream`, then `stream.completion`."""

    def __init__(self) -> None:
        self.completion: Optional[Completion] = None
        self._deltas: Optional[AsyncIterator[str]] = None

    def __aiter__(self) -> AsyncIterator[str]:
        return self._deltas


class AsyncClient(_ClientCore):
    """Asyncio client with the same behaviour as `Client`; `sleep` is an async callable."""

    _text_stream = AsyncTextStream

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: Optional[str] = None, *,
                 retry: RetryPolicy = RetryPolicy(), timeouts: Timeouts = Timeouts(),
                 rng: Optional[random.Random] = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] = asyncio.sleep, http: Optional[httpx.AsyncClient] = None,
                 max_connections: int = 100):
        super().__init__(base_url, api_key, retry=retry, timeouts=timeouts, rng=rng, clock=clock)
        self.sleep = sleep
        self.http = http or httpx.AsyncClient(limits=httpx.Limits(max_connections=max_connections))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def models(self) -> list[str]:
        return await self._run(self._models_plan())

    async def create(self, endpoint: str, body: Mapping[str, Any], *, stream: bool = False) -> Completion:
        if stream:
            text_stream = self._stream(endpoint, body, restartable=True)
            async for _ in text_stream:
                pass
            return text_stream.completion
        return await self._run(self._completion_plan(endpoint, body))

    async def chat(self, body: Mapping[str, Any], *, stream: bool = False) -> Completion:
        return await self.create("chat", body, stream=stream)

    async def completions(self, body: Mapping[str, Any], *, stream: bool = False) -> Completion:
        return await self.create("completions", body, stream=stream)

    async def _run(self, plan: Plan) -> Any:
        result: list = []
        async for _ in self._drive(plan, result.append):
            pass
        return result[0]

    async def _drive(self, plan: Plan, done: Callable[[Any], None]) -> AsyncIterator[str]:
        """The asyncio transport: Client._drive, awaiting each step."""
        async with contextlib.AsyncExitStack() as open_response:
            reply: Any = None
            error: Optional[APIError] = None
            response: Any = None
            lines: Optional[AsyncIterator[str]] = None
            try:
                while True:
                    try:
                        step = plan.send(reply) if error is None else plan.throw(error)
                    except StopIteration as stop:
                        done(stop.value)
                        return
                    reply, error = None, None
                    if isinstance(step, _Delta):
                        yield step.text
                        continue
                    if not isinstance(step, (_ReadBody, _ReadLine)):
                        await open_response.aclose()  # an attempt's response is closed before anything else happens
                    if isinstance(step, _Wait):
                        await self.sleep(step.seconds)
                        continue
                    try:
                        with _transport_errors():
                            if isinstance(step, _ReadLine):
                                reply = await anext(lines, None)
                            elif isinstance(step, _ReadBody):
                                reply = await response.aread()
                            elif step.stream:
                                response = reply = await open_response.enter_async_context(self.http.stream(
                                    step.method, step.url, json=step.payload, headers=self._headers(),
                                    timeout=self._timeout(step.budget)))
                                lines = response.aiter_lines()
                            else:
                                reply = await self.http.request(step.method, step.url, json=step.payload,
                                                                headers=self._headers(),
                                                                timeout=self._timeout(step.budget))
                    except APIError as exc:
                        error = exc
            finally:
                plan.close()


def _model_ids(response: httpx.Response) -> list[str]:
    try:
        return [str(entry["id"]) for entry in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise APIResponseError(f"unreadable model list: {response.text[:200]!r}") from exc
