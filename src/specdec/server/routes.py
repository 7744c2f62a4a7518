"""The HTTP routes: OpenAI chat and text completions, models, health and metrics."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional, Union

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request
from starlette.responses import Response

from specdec.drafters.history import tenant_of_api_key
from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.convert import check_model, encode_prompt, generation_request
from specdec.server.drain import Drain
from specdec.server.errors import APIError, json_response
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList,
    PromptTokensDetails, Usage,
)
from specdec.server.openapi import error_responses, event_stream_response
from specdec.server.scheduler import Scheduler
from specdec.server.sse import DONE, EventStreamResponse, sse_data, sse_error
from specdec.server.tickets import Failed, QueueFull, Refused, Started, Ticket, queue_timeout_error
from specdec.types import StreamEvent

ERRORS = error_responses()
STREAM_CHUNKS = (ChatCompletionChunk, CompletionResponse)  # documented in openapi.py's event stream


@dataclass
class ServerState:
    engine: Engine
    config: ServerConfig
    scheduler: Scheduler
    metrics: ServerMetrics
    created: int
    drain: Drain
    # How /metrics text is produced from this app's metrics; None: the app's own registry. A Ray
    # replica merges every replica's series here (deploy/metrics.py).
    metrics_exposition: Optional[Callable[[ServerMetrics], Awaitable[bytes]]] = None


def state_of(request: Request) -> ServerState:
    return request.app.state.specdec


router = APIRouter()


# -- plain routes ------------------------------------------------------------------------------
@router.get("/health", summary="Health: 503 with a reason while draining or while the backend is stalled")
async def health(request: Request) -> Response:
    scheduler = state_of(request).scheduler
    health = scheduler.health()
    if health.status != "ok":
        return json_response({"status": health.status, "reason": health.reason}, 503)
    return json_response({"status": "ok", "running": scheduler.num_running, "waiting": scheduler.num_waiting})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    state = state_of(request)
    body = await state.metrics_exposition(state.metrics) if state.metrics_exposition else state.metrics.render()
    return Response(body, media_type=state.metrics.content_type)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = state_of(request)
    return ModelList(data=[ModelCard(id=state.config.served_model_name, created=state.created)])


@router.get("/v1/models/{model}", response_model=ModelCard, responses=ERRORS)
async def get_model(model: str, request: Request) -> ModelCard:
    state = state_of(request)
    check_model(model, state.config)
    return ModelCard(id=model, created=state.created)


# -- completions -------------------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={**event_stream_response(ChatCompletionChunk), **ERRORS},
             summary="Chat completion (stream: text/event-stream of chat.completion.chunk)")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _complete(request, body, _ChatFormat(state_of(request).config.served_model_name))


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**event_stream_response(CompletionResponse), **ERRORS},
             summary="Text completion (stream: text/event-stream of text_completion chunks)")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _complete(request, body, _TextFormat(state_of(request).config.served_model_name))


class _ChatFormat:
    def __init__(self, model: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def response(self, text: str, finish_reason: str, usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            ChatChoice(message=ChatResponseMessage(content=text), finish_reason=finish_reason)])

    def opening(self) -> list[ChatCompletionChunk]:
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def chunk(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text))

    def closing(self, finish_reason: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), finish_reason)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def _chunk(self, delta: ChatDelta, finish_reason: Optional[str] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])


class _TextFormat:
    def __init__(self, model: str):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def response(self, text: str, finish_reason: str, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)])

    def opening(self) -> list[CompletionResponse]:
        return []

    def chunk(self, text: str) -> CompletionResponse:
        return self._chunk(text)

    def closing(self, finish_reason: str) -> CompletionResponse:
        return self._chunk("", finish_reason)

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def _chunk(self, text: str, finish_reason: Optional[str] = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)])


Format = Union[_ChatFormat, _TextFormat]


def usage_from(stats: dict) -> Usage:
    prompt, completion = stats.get("prompt_tokens", 0), stats.get("generated_tokens", 0)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.get("cached_prompt_tokens", 0)),
                 speculative=stats)


def finish_reason_of(event: StreamEvent) -> str:
    # "cancelled" reaches a client only when the server's time limit cut the generation.
    return "length" if event.finish_reason == "cancelled" else event.finish_reason


def tenant_of(request: Request) -> str:
    """Requests with the same bearer token share a cross-request history; others never do."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return tenant_of_api_key(token.strip() if scheme.lower() == "bearer" else None)


async def _complete(request: Request, body: Union[ChatCompletionRequest, CompletionRequest], fmt: Format) -> Response:
    state = state_of(request)
    check_model(body.model, state.config)
    try:
        state.scheduler.check_accepting()  # before encoding a prompt nobody will generate from
        # Chat templates and tokenizers can take a while on long prompts: off the event loop, and
        # within the time limit (a stuck tokenizer must not hold the request forever).
        with anyio.fail_after(state.config.request_timeout):
            prompt_ids = await anyio.to_thread.run_sync(encode_prompt, state.engine, body, abandon_on_cancel=True)
        gen_request = generation_request(state.engine, state.config, body, prompt_ids, tenant_of(request))
        ticket = state.scheduler.submit(gen_request, asyncio.get_running_loop())
    except QueueFull:
        raise APIError(429, "the server is at capacity: every slot is busy and the queue is full; retry later.",
                       "rate_limit_error", None, "queue_full",
                       {"Retry-After": str(state.config.retry_after)}) from None
    except Refused as refused:
        raise refused.error from None
    except TimeoutError:
        raise queue_timeout_error(state.config.request_timeout, state.config.retry_after) from None
    watcher = asyncio.create_task(_cancel_on_disconnect(request, ticket))
    streaming = False
    try:
        first = await ticket.next()
        if isinstance(first, Failed):
            raise first.error
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            watcher.cancel()
            streaming = True
            return EventStreamResponse(_stream(ticket, fmt, include_usage), on_close=ticket.cancel)
        text, event = await _collect(ticket)
        return json_response(fmt.response(text, finish_reason_of(event), usage_from(event.stats or {}))
                             .model_dump(mode="json"))
    finally:
        if not streaming:
            watcher.cancel()
            ticket.cancel()  # a no-op once finished; frees the slot if this handler was interrupted


async def _cancel_on_disconnect(request: Request, ticket: Ticket) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.cancel()
            return


async def _collect(ticket: Ticket) -> tuple[str, StreamEvent]:
    parts = []
    while True:
        item = await ticket.next()
        if isinstance(item, Failed):
            raise item.error
        if isinstance(item, StreamEvent):
            parts.append(item.text)
            if item.finish_reason is not None:
                return "".join(parts), item


async def _stream(ticket: Ticket, fmt: Format, include_usage: bool) -> AsyncIterator[bytes]:
    """The chunks of a started generation, then `data: [DONE]`. A failure after the stream has
    started (the backend failed or stalled, the drain's grace period ran out) can no longer change
    the HTTP status: it ends the stream with ONE error event, `data: {"error": {...}}` (OpenAI's
    shape, which the `openai` client raises as APIError), in place of the finish_reason chunk."""
    for chunk in fmt.opening():
        yield sse_data(chunk)
    while True:
        item = await ticket.next()
        if isinstance(item, Started):
            continue
        if isinstance(item, Failed):
            yield sse_error(item.error)
            break
        if item.text:
            yield sse_data(fmt.chunk(item.text))
        if item.finish_reason is not None:
            yield sse_data(fmt.closing(finish_reason_of(item)))
            if include_usage:
                yield sse_data(fmt.usage_chunk(usage_from(item.stats or {})))
            break
    yield DONE
