"""The HTTP routes: OpenAI chat and text completions, models, health and metrics."""
from __future__ import annotations

import asyncio
import codecs
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence, Union

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request
from starlette.responses import Response

from specdec.drafters.history import UNSHARED_TENANT
from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.convert import check_model, check_prompt_size, encode_prompt, generation_request
from specdec.server.drain import Drain
from specdec.server.errors import APIError, json_response
from specdec.server.limits import OffLoopJSONRoute
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList,
    PromptTokensDetails, Usage,
)
from specdec.server.openapi import error_responses, event_stream_response
from specdec.server.scheduler import Scheduler
from specdec.server.sse import DONE, KEEPALIVE, EventStreamResponse, sse_data, sse_error
from specdec.server.tenants import tenant_of_scope
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


router = APIRouter(route_class=OffLoopJSONRoute)


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


def tenant_of(request: Request) -> Optional[str]:
    """Whose cross-request history a request drafts from and adds to: the tenant of its
    authenticated key (tenants.py), never a bearer string nobody checked. Without keys: nobody's
    (an empty history of its own), or with --shared-history the one anonymous history (None)."""
    tenant = tenant_of_scope(request.scope)
    if tenant is not None:
        return tenant
    return None if state_of(request).config.shared_history else UNSHARED_TENANT


async def _complete(request: Request, body: Union[ChatCompletionRequest, CompletionRequest], fmt: Format) -> Response:
    state = state_of(request)
    check_model(body.model, state.config)
    try:
        state.scheduler.check_accepting()  # before encoding a prompt nobody will generate from
        check_prompt_size(state.engine, state.config, body)  # before tokenizing one that cannot fit
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
    config = state.config
    try:
        if body.stream:
            # A failure before the generation starts is an HTTP status, as long as the wait is
            # short; a stream still queued after `sse_keepalive` seconds starts its 200 response
            # and sends keep-alive comments meanwhile (a failure is then the error event).
            try:
                first = await asyncio.wait_for(ticket.next(), config.sse_keepalive)
            except asyncio.TimeoutError:
                first = None
            if isinstance(first, Failed):
                raise first.error
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            watcher.cancel()
            streaming = True
            pieces = TokenPieces(state.engine.target.token_bytes) if config.stream_one_token_per_chunk else None
            return EventStreamResponse(_stream(ticket, fmt, include_usage, config.sse_keepalive,
                                               started=first is not None, pieces=pieces),
                                       on_close=ticket.cancel, write_timeout=config.write_timeout)
        first = await ticket.next()
        if isinstance(first, Failed):
            raise first.error
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


class TokenPieces:
    """Cuts a stream's text into one piece per token, so that a chunk's size does not say how
    many drafted tokens its decoding step accepted (arXiv 2411.01076).

    The pieces are cut from the events' own text, so they concatenate to exactly what the engine
    streams (stop strings cut, text held back for a possible stop string sent later); the tokens'
    bytes, decoded as the engine decodes them (stopping.py), only say where the cuts fall. A token
    whose bytes end inside a UTF-8 character ends no piece: the character goes with the token that
    completes it, so no piece holds a broken character.

    Example: one event with tokens "the ", b"\xc3", b"\xa9", "!" and text "the é!" -> pieces
    "the ", "é", "!" (b"\xc3" alone decodes to nothing).
    """

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoded = 0  # characters the tokens so far decode to
        self._ends: deque[int] = deque()  # where tokens' text ends (characters from the start), not yet passed
        self._streamed = 0  # characters of the stream's text cut so far

    def split(self, text: str, token_ids: Sequence[int]) -> list[str]:
        for token in token_ids:
            added = len(self._decoder.decode(self._token_bytes(token)))
            if added:
                self._decoded += added
                self._ends.append(self._decoded)
        start, end, pieces = self._streamed, self._streamed + len(text), []
        cut = start
        while self._ends and self._ends[0] <= end:
            boundary = self._ends.popleft()
            if boundary > cut:
                pieces.append(text[cut - start:boundary - start])
                cut = boundary
        if cut < end:  # text past the last token end: the start of a token held back, or the final flush
            pieces.append(text[cut - start:])
        self._streamed = end
        return pieces


async def _stream(ticket: Ticket, fmt: Format, include_usage: bool, keepalive: float,
                  started: bool = True, pieces: Optional[TokenPieces] = None) -> AsyncIterator[bytes]:
    """The chunks of a generation, then `data: [DONE]`. A failure after the stream has started
    (the backend failed or stalled, the drain's grace period ran out; with `started` False, also
    a failure while still queued) can no longer change the HTTP status: it ends the stream with
    ONE error event, `data: {"error": {...}}` (OpenAI's shape, which the `openai` client raises
    as APIError), in place of the finish_reason chunk. A wait of `keepalive` seconds without an
    event sends a `: keep-alive` comment (clients ignore comments; proxies see a live stream).
    With `pieces`, an event's text goes out as one chunk per token (TokenPieces)."""
    if started:
        for chunk in fmt.opening():
            yield sse_data(chunk)
    while True:
        try:
            item = await asyncio.wait_for(ticket.next(), keepalive)
        except asyncio.TimeoutError:
            yield KEEPALIVE
            continue
        if isinstance(item, Started):
            if not started:
                started = True
                for chunk in fmt.opening():
                    yield sse_data(chunk)
            continue
        if isinstance(item, Failed):
            yield sse_error(item.error)
            break
        # Every event goes through `pieces`, with text or not: its tokens' bytes place later cuts.
        for text in pieces.split(item.text, item.token_ids) if pieces is not None else [item.text]:
            if text:
                yield sse_data(fmt.chunk(text))
        if item.finish_reason is not None:
            yield sse_data(fmt.closing(finish_reason_of(item)))
            if include_usage:
                yield sse_data(fmt.usage_chunk(usage_from(item.stats or {})))
            break
    yield DONE
