"""A fault-injecting OpenAI-compatible server for client and batch tests, on 127.0.0.1 and a free port.

Normal answers follow the OpenAI shapes (chat and completions, streamed or not, `/v1/models`) and
carry a `usage.speculative` block unless the request turned speculation off. Faults are scripted
per prompt with a directive in the prompt text (the last message's content for chat):

    "say hi [[faults: 429, 500, drop]]"   attempt 1 → 429, attempt 2 → 500, attempt 3 → the
                                           connection drops mid-answer, attempt 4 and later → ok
    "say hi [[always: 400]]"               every attempt → 400

Faults: `429` or `429:SECONDS` (with Retry-After), `500`, `503`, `400` (OpenAI-shaped
invalid_request_error), `slow` (waits `slow_seconds` before answering), `drop` (the connection is
closed after `drop_after_chunks` chunks, or midway through a JSON body). `burst_429` answers the
first N requests of any prompt with 429. Every request is recorded in `server.requests`.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

DIRECTIVE = re.compile(r"\[\[(faults|always):([^\]]*)\]\]")


@dataclass
class FakeServerConfig:
    model: str = "fake-model"
    answer_tokens: int = 8  # tokens per answer when max_tokens does not ask for fewer
    token_delay: float = 0.0  # seconds per token with speculation off
    spec_speedup: float = 2.0  # speculation divides the per-token delay by this
    retry_after: str = "0.01"  # Retry-After sent with scripted and burst 429s
    burst_429: int = 0
    slow_seconds: float = 2.0
    drop_after_chunks: int = 2
    api_key: Optional[str] = None


@dataclass
class Received:
    endpoint: str
    key: str  # the prompt text, directive included
    attempt: int  # 1-based, per key
    fault: Optional[str]
    body: dict = field(repr=False, default_factory=dict)


class _Dropped(Exception):
    """Raised inside a streaming body: uvicorn then closes the connection without finishing it."""


def _prompt_text(endpoint: str, body: dict) -> str:
    if endpoint == "chat":
        messages = body.get("messages") or [{}]
        content = messages[-1].get("content")
        return content if isinstance(content, str) else json.dumps(content)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _error(status: int, message: str, type_: str, param: Optional[str] = None, headers: Optional[dict] = None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": None}},
                        status_code=status, headers=headers)


def _spec_method(body: dict) -> str:
    value = body.get("speculative_decoding", True)
    if value is False:
        return "off"
    if isinstance(value, dict):
        return str(value.get("method", "ngram"))
    return "ngram"


def create_app(config: FakeServerConfig) -> FastAPI:
    app = FastAPI()
    app.state.config = config
    app.state.requests = []
    app.state.in_flight = 0
    app.state.peak_in_flight = 0  # most requests being answered at once
    attempts: dict[str, int] = {}

    def enter() -> None:
        app.state.in_flight += 1
        app.state.peak_in_flight = max(app.state.peak_in_flight, app.state.in_flight)

    def leave() -> None:
        app.state.in_flight -= 1

    def authorized(request: Request) -> bool:
        return config.api_key is None or request.headers.get("authorization") == f"Bearer {config.api_key}"

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return _error(401, "invalid api key", "authentication_error")
        return {"object": "list", "data": [{"id": config.model, "object": "model", "owned_by": "fake"}]}

    async def handle(endpoint: str, request: Request):
        if not authorized(request):
            return _error(401, "invalid api key", "authentication_error")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not valid JSON", "invalid_request_error")
        key = _prompt_text(endpoint, body)
        attempts[key] = attempts.get(key, 0) + 1
        fault = _fault_for(key, attempts[key])
        if fault is None and len(app.state.requests) < config.burst_429:
            fault = "429"
        app.state.requests.append(Received(endpoint, key, attempts[key], fault, body))
        if body.get("model") != config.model:
            return _error(404, f"model {body.get('model')!r} not found", "invalid_request_error", "model")
        if fault and fault.startswith("429"):
            retry_after = fault.split(":", 1)[1] if ":" in fault else config.retry_after
            return _error(429, "server busy, retry later", "rate_limit_error", headers={"Retry-After": retry_after})
        if fault in ("500", "503"):
            return _error(int(fault), "injected server error", "server_error")
        if fault == "400":
            return _error(400, "messages must not be empty", "invalid_request_error", "messages")
        enter()
        streaming = False
        try:
            if fault == "slow":
                await asyncio.sleep(config.slow_seconds)
            response = await _answer(endpoint, body, key, drop=(fault == "drop"))
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:
                leave()

    async def _answer(endpoint: str, body: dict, key: str, drop: bool):
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or config.answer_tokens
        n_tokens = min(int(max_tokens), config.answer_tokens)
        pieces = [f"t{i} " for i in range(n_tokens)]
        method = _spec_method(body)
        delay = config.token_delay / (config.spec_speedup if method != "off" else 1.0)
        usage = {"prompt_tokens": len(key.split()), "completion_tokens": n_tokens,
                 "total_tokens": len(key.split()) + n_tokens}
        if method != "off":
            rounds = max(1, n_tokens // 2)
            usage["speculative"] = {"method": method, "num_draft_tokens": 3, "draft_rounds": rounds,
                                    "drafted_tokens": 3 * rounds, "accepted_tokens": rounds,
                                    "acceptance_rate": 1 / 3, "mean_acceptance_length": 2.0}
        finish = "length" if n_tokens == max_tokens else "stop"
        created = int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(endpoint, pieces, finish, usage if include_usage else None, created,
                                          delay, drop), media_type="text/event-stream")
        if endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(pieces)}, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(pieces), "finish_reason": finish}
            obj = "text_completion"
        payload = {"id": "cmpl-fake", "object": obj, "created": created, "model": config.model,
                   "choices": [choice], "usage": usage}
        if drop:
            return StreamingResponse(_torn_json(json.dumps(payload)), media_type="application/json")
        await asyncio.sleep(delay * n_tokens)
        return payload

    async def _torn_json(text: str):
        try:
            yield text[: len(text) // 2].encode()
            await asyncio.sleep(0.01)
            raise _Dropped("injected drop")
        finally:
            leave()

    async def _sse(endpoint, pieces, finish, usage, created, delay, drop):
        def chunk(choice_delta, finish_reason=None, usage_block=None, choices=True):
            if endpoint == "chat":
                choice = {"index": 0, "delta": choice_delta, "finish_reason": finish_reason}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": choice_delta.get("content", ""), "finish_reason": finish_reason}
                obj = "text_completion"
            data = {"id": "cmpl-fake", "object": obj, "created": created, "model": config.model,
                    "choices": [choice] if choices else []}
            if usage_block is not None:
                data["usage"] = usage_block
            return f"data: {json.dumps(data)}\n\n".encode()

        try:
            if endpoint == "chat":
                yield chunk({"role": "assistant", "content": ""})
            for i, piece in enumerate(pieces):
                if drop and i == config.drop_after_chunks:
                    raise _Dropped("injected drop")
                if delay:
                    await asyncio.sleep(delay)
                yield chunk({"content": piece})
            if drop:
                raise _Dropped("injected drop")
            yield chunk({}, finish)
            if usage is not None:
                yield chunk({}, usage_block=usage, choices=False)
            yield b"data: [DONE]\n\n"
        finally:
            leave()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("completions", request)

    return app


def _fault_for(key: str, attempt: int) -> Optional[str]:
    match = DIRECTIVE.search(key)
    if not match:
        return None
    faults = [f.strip() for f in match.group(2).split(",") if f.strip()]
    if match.group(1) == "always":
        return faults[0] if faults else None
    return faults[attempt - 1] if attempt <= len(faults) else None


class FakeServer:
    """Runs the fake app with uvicorn in a background thread: `with FakeServer(cfg) as server: ...`."""

    def __init__(self, config: Optional[FakeServerConfig] = None):
        self.config = config or FakeServerConfig()
        self.app = create_app(self.config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="critical", lifespan="off",
                                                     timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def requests(self) -> list[Received]:
        return self.app.state.requests

    def start(self) -> "FakeServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> "FakeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
