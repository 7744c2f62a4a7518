"""The HTTP routes: OpenAI chat and text completions, models, health and metrics."""
from __future__ import annotations

import asyncio
import codecs
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence, Union

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request
from starlette.responses import Response

from specdec.drafters.history import UNSHARED_TENANT
from specdec.engine.engine import Engine
from specdec.server.choices import (
    ChatLogprobBuilder, LogprobQueue, TextLogprobBuilder, TicketMerge, joined, usage_of,
)
from specdec.server.config import ServerConfig
from specdec.server.convert import check_model, check_prompt_size, choice_requests, encode_prompt, generation_request
from specdec.server.drain import Drain
from specdec.server.errors import APIError, json_response
from specdec.server.fim import InfillRequest, infill_response
from specdec.server.limits import OffLoopJSONRoute
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList,
    StreamOptions, Usage,
)
from specdec.server.openapi import error_responses, event_stream_response
from specdec.server.scheduler import Scheduler
from specdec.server.speculative import HISTORY_SOURCES, SourceAnnotator, wants_rejected
from specdec.server.sse import DONE, KEEPALIVE, EventStreamResponse, sse_data, sse_error
from specdec.server.tenants import tenant_of_scope
from specdec.server.tickets import Failed, Item, QueueFull, Refused, Started, queue_timeout_error
from specdec.server.tools import ToolCallDelta, ToolStreamParser, calls_expected, calls_finish_reason, parse_output
from specdec.types import StreamEvent, TokenLogprob

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
    return await _complete(request, body, _ChatFormat(state_of(request).config.served_model_name,
                                                      tool_calling=calls_expected(body)))


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**event_stream_response(CompletionResponse), **ERRORS},
             summary="Text completion (stream: text/event-stream of text_completion chunks)")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _complete(request, body, _TextFormat(state_of(request).config.served_model_name))


# llama-server's API, not OpenAI's (its stream ends with no [DONE]): out of the OpenAPI document, in docs/server.md.
@router.post("/infill", include_in_schema=False)
async def infill(body: InfillRequest, request: Request) -> Response:
    return await infill_response(request, body, state_of(request), tenant_of(request))


class _ChatFormat:
    def __init__(self, model: str, tool_calling: bool = False):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tool_calling = tool_calling  # the output is read for <tool_call> blocks (tools.py)

    def response(self, text: str, finish_reason: str, usage: Usage) -> ChatCompletionResponse:
        message = ChatResponseMessage(content=text)
        if self.tool_calling:
            parsed = parse_output(text)
            message = ChatResponseMessage(content=parsed.content, tool_calls=parsed.tool_calls or None)
            finish_reason = calls_finish_reason(finish_reason, len(parsed.tool_calls))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            ChatChoice(message=message, finish_reason=finish_reason)])

    def tool_parser(self) -> Optional[ToolStreamParser]:
        return ToolStreamParser() if self.tool_calling else None

    def tool_chunk(self, delta: ToolCallDelta) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(tool_calls=[delta]))

    def opening(self) -> list[ChatCompletionChunk]:
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def chunk(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text))

    def closing(self, finish_reason: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), finish_reason)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    @staticmethod
    def logprobs_builder(token_bytes: Callable[[int], bytes]) -> ChatLogprobBuilder:
        return ChatLogprobBuilder(token_bytes)

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

    @staticmethod
    def logprobs_builder(token_bytes: Callable[[int], bytes]) -> TextLogprobBuilder:
        return TextLogprobBuilder(token_bytes)

    def _chunk(self, text: str, finish_reason: Optional[str] = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)])


Format = Union[_ChatFormat, _TextFormat]


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
    n = body.n or 1  # each choice is a request of its own in the scheduler
    try:
        state.scheduler.check_accepting(n)  # before encoding a prompt nobody will generate from
        check_prompt_size(state.engine, state.config, body)  # before tokenizing one that cannot fit
        # Chat templates and tokenizers can take a while on long prompts: off the event loop, and
        # within the time limit (a stuck tokenizer must not hold the request forever).
        with anyio.fail_after(state.config.request_timeout):
            prompt_ids = await anyio.to_thread.run_sync(encode_prompt, state.engine, body, abandon_on_cancel=True)
        gen_request = generation_request(state.engine, state.config, body, prompt_ids, tenant_of(request))
        tickets = state.scheduler.submit_many(choice_requests(gen_request, n), asyncio.get_running_loop())
    except QueueFull:
        raise APIError(429, "the server is at capacity: every slot is busy and the queue is full; retry later.",
                       "rate_limit_error", None, "queue_full",
                       {"Retry-After": str(state.config.retry_after)}) from None
    except Refused as refused:
        raise refused.error from None
    except TimeoutError:
        raise queue_timeout_error(state.config.request_timeout, state.config.retry_after) from None
    merge = TicketMerge(tickets)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, merge))
    streaming = False
    config = state.config
    token_bytes = state.engine.target.token_bytes
    logprobs = gen_request.logprobs is not None
    echo = _echo(state.engine, body, prompt_ids)
    try:
        if body.stream:
            # A failure before the generation starts is an HTTP status, as long as the wait is
            # short; a stream still queued after `sse_keepalive` seconds starts its 200 response
            # and sends keep-alive comments meanwhile (a failure is then the error event).
            early = await _opening_items(merge, n, config.sse_keepalive)
            failed = next((item for _, item in early if isinstance(item, Failed)), None)
            if failed is not None:
                raise failed.error
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            watcher.cancel()
            streaming = True
            choices = [_StreamChoice(index, fmt, token_bytes, logprobs=logprobs, echo=echo,
                                     pieces=TokenPieces(token_bytes) if config.stream_one_token_per_chunk else None,
                                     annotator=annotator_for(request, body.stream_options))
                       for index in range(n)]
            return EventStreamResponse(_stream(merge, fmt, choices, include_usage, config.sse_keepalive, early),
                                       on_close=merge.cancel, write_timeout=config.write_timeout)
        results = await _collect(merge, n)
        return json_response(_response(fmt, results, token_bytes, logprobs, echo).model_dump(mode="json"))
    finally:
        if not streaming:
            watcher.cancel()
            merge.cancel()  # a no-op once finished; frees the slots if this handler was interrupted


async def _cancel_on_disconnect(request: Request, merge: TicketMerge) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            merge.cancel()
            return


def _echo(engine: Engine, body: Union[ChatCompletionRequest, CompletionRequest],
          prompt_ids: list[int]) -> Optional[tuple[str, list[int]]]:
    """Completions' `echo`: the prompt's text as sent (token ids sent: their text), and its ids."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return engine.target.detokenize(prompt_ids), prompt_ids
    return (prompt[0] if isinstance(prompt, list) else prompt), prompt_ids


@dataclass
class _Collected:
    """One choice of a response that is not streamed."""

    started: Optional[Started] = None
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: Optional[StreamEvent] = None


async def _collect(merge: TicketMerge, n: int) -> list[_Collected]:
    """Every choice to its end; a choice's failure is the request's."""
    results = [_Collected() for _ in range(n)]
    left = n
    while left:
        index, item = await merge.next()
        if isinstance(item, Failed):
            raise item.error
        result = results[index]
        if isinstance(item, Started):
            result.started = item
            continue
        result.parts.append(item.text)
        result.logprobs.extend(item.logprobs or ())
        if item.finish_reason is not None:
            result.final = item
            left -= 1
    return results


def _response(fmt: Format, results: list[_Collected], token_bytes: Callable[[int], bytes], logprobs: bool,
              echo: Optional[tuple[str, list[int]]]) -> Union[ChatCompletionResponse, CompletionResponse]:
    usage = usage_of([result.final.stats or {} for result in results])
    choices = []
    for index, result in enumerate(results):
        prefix = echo[0] if echo is not None else ""
        response = fmt.response(prefix + "".join(result.parts), finish_reason_of(result.final), usage)
        choice = response.choices[0]
        choice.index = index
        if logprobs:
            builder = fmt.logprobs_builder(token_bytes)
            prompt = _echo_logprobs(builder, echo, result.started) if echo is not None else None
            generated = builder.build(result.logprobs, [entry.token_id for entry in result.logprobs])
            choice.logprobs = generated if prompt is None else joined(prompt, generated)
        choices.append(choice)
    response.choices = choices
    return response


def _echo_logprobs(builder: TextLogprobBuilder, echo: tuple[str, list[int]], started: Optional[Started]):
    """The echoed prompt's logprobs (its first token has none), and the completion's offsets after it."""
    text, ids = echo
    scored = started.prompt_logprobs if started is not None and started.prompt_logprobs is not None else []
    prompt = builder.build([None, *scored], ids[:len(scored) + 1])
    builder.offset = len(text)
    return prompt


async def _opening_items(merge: TicketMerge, n: int, wait: float) -> list[tuple[int, Item]]:
    """The items that arrive within `wait` seconds, until every choice has started or one failed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    items: list[tuple[int, Item]] = []
    started: set[int] = set()
    while len(started) < n and loop.time() < deadline:
        try:
            index, item = await asyncio.wait_for(merge.next(), deadline - loop.time())
        except asyncio.TimeoutError:
            break
        items.append((index, item))
        if isinstance(item, Failed):
            break
        started.add(index)
    return items


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
        # Where tokens' text ends (characters from the start), not yet passed, each with how many
        # tokens end there (a token that completes no character counts with the one that does).
        self._ends: deque[tuple[int, int]] = deque()
        self._streamed = 0  # characters of the stream's text cut so far
        self._unended = 0  # tokens since the last end
        self._passed = 0  # tokens of ends passed without a piece of their own, for the next piece

    def split(self, text: str, token_ids: Sequence[int]) -> list[str]:
        return [piece for piece, _ in self.split_counted(text, token_ids)]

    def split_counted(self, text: str, token_ids: Sequence[int]) -> list[tuple[str, int]]:
        """The pieces, each with the number of tokens whose text ends in it (speculative.py)."""
        for token in token_ids:
            added = len(self._decoder.decode(self._token_bytes(token)))
            self._unended += 1
            if added:
                self._decoded += added
                self._ends.append((self._decoded, self._unended))
                self._unended = 0
        start, end, pieces = self._streamed, self._streamed + len(text), []
        cut = start
        while self._ends and self._ends[0][0] <= end:
            boundary, count = self._ends.popleft()
            self._passed += count
            if boundary > cut:
                pieces.append((text[cut - start:boundary - start], self._passed))
                cut, self._passed = boundary, 0
        if cut < end:  # text past the last token end: the start of a token held back, or the final flush
            pieces.append((text[cut - start:], 0))
        self._streamed = end
        return pieces


def annotator_for(request: Request, options: Optional[StreamOptions]) -> Optional[SourceAnnotator]:
    """The `speculative` extension's annotator, when the request asked for it (speculative.py)."""
    rejected = wants_rejected(options)
    if rejected is None:
        return None
    token_bytes = state_of(request).engine.target.token_bytes
    # Tenant None: the history every anonymous client shares, whose text is theirs, not this one's.
    hidden = HISTORY_SOURCES if tenant_of(request) is None else frozenset()
    return SourceAnnotator(TokenPieces(token_bytes), token_bytes, rejected, hidden)


class _StreamChoice:
    """One choice of a stream: how its events' text is cut into chunks (`pieces`: one per token;
    `annotator`: the same, each with its `speculative` object, speculative.py), which tokens'
    log-probabilities go with each chunk, and its echoed prompt."""

    def __init__(self, index: int, fmt: Format, token_bytes: Callable[[int], bytes], *, logprobs: bool,
                 echo: Optional[tuple[str, list[int]]], pieces: Optional[TokenPieces],
                 annotator: Optional[SourceAnnotator]):
        self.index = index
        self.fmt = fmt
        self.echo = echo
        self.pieces = pieces
        self.annotator = annotator
        self.queue = LogprobQueue(token_bytes) if logprobs else None
        self.builder = fmt.logprobs_builder(token_bytes) if logprobs else None
        self.tools = fmt.tool_parser() if isinstance(fmt, _ChatFormat) else None  # content vs tool calls

    def opening(self, started: Started) -> list:
        chunks = list(self.fmt.opening())
        if self.echo is not None:
            chunk = self.fmt.chunk(self.echo[0])
            if self.builder is not None:
                chunk.choices[0].logprobs = _echo_logprobs(self.builder, self.echo, started)
            chunks.append(chunk)
        return self._indexed(chunks)

    def chunks(self, event: StreamEvent) -> list:
        if self.queue is not None and event.logprobs:
            self.queue.add(event.token_ids, event.logprobs)
        chunks = []
        if self.annotator is not None:
            for text, extension in self.annotator.split(event):
                chunks += self._text_chunks(text, {"speculative": extension})
        else:
            # Every event goes through `pieces`, with text or not: its tokens' bytes place later cuts.
            for text in self.pieces.split(event.text, event.token_ids) if self.pieces is not None else [event.text]:
                if text:
                    chunks += self._text_chunks(text)
        if event.finish_reason is not None:
            finish_reason = finish_reason_of(event)
            if self.tools is not None:
                chunks += [self._tool_item(item) for item in self.tools.finish()]
                finish_reason = calls_finish_reason(finish_reason, self.tools.index)
            if self.queue is not None and (rest := self.queue.rest()):
                chunks.append(self._with_logprobs(self.fmt.chunk(""), rest))  # tokens whose text a stop string cut
            closing = self.fmt.closing(finish_reason)
            if self.annotator is not None:
                closing = closing.model_copy(update={"speculative": self.annotator.rest()})
            chunks.append(closing)
        return self._indexed(chunks)

    def _text_chunks(self, text: str, update: Optional[dict] = None) -> list:
        """A piece of the generated text as chunks: itself, or with tool calling what the parser
        makes of it (content, delta.tool_calls); the piece's extension and logprobs go with the
        first, or with an empty content chunk while the parser holds the text back."""
        if self.tools is None:
            return [self._chunk(text, update)]
        made = [self._tool_item(item) for item in self.tools.feed(text)]
        entries = self.queue.take(text) if self.queue is not None else []
        if not made and not update and not entries:
            return []
        first = made[0] if made else self.fmt.chunk("")
        if update:
            first = first.model_copy(update=update)
        return [self._with_logprobs(first, entries), *made[1:]]

    def _tool_item(self, item):
        return self.fmt.chunk(item) if isinstance(item, str) else self.fmt.tool_chunk(item)

    def _chunk(self, text: str, update: Optional[dict] = None):
        chunk = self.fmt.chunk(text)
        if update:
            chunk = chunk.model_copy(update=update)
        return self._with_logprobs(chunk, self.queue.take(text)) if self.queue is not None else chunk

    def _with_logprobs(self, chunk, entries: list[TokenLogprob]):
        if entries:
            chunk.choices[0].logprobs = self.builder.build(entries, [entry.token_id for entry in entries])
        return chunk

    def _indexed(self, chunks: list) -> list:
        for chunk in chunks:
            for choice in chunk.choices:
                choice.index = self.index
        return chunks


async def _stream(merge: TicketMerge, fmt: Format, choices: list[_StreamChoice], include_usage: bool,
                  keepalive: float, early: Sequence[tuple[int, Item]] = ()) -> AsyncIterator[bytes]:
    """The chunks of every choice's generation as they come, then `data: [DONE]`; `early`: items
    read before the response started, sent first. A choice's chunks begin when its prompt is
    processed (chat: the role chunk; completions with echo: the prompt) and end with its
    finish_reason chunk; the usage chunk (stream_options.include_usage) follows the last.
    A failure after the stream has started (the backend failed or stalled, the drain's grace
    period ran out; also a failure while still queued) can no longer change the HTTP status: it
    ends the stream with ONE error event, `data: {"error": {...}}` (OpenAI's shape, which the
    `openai` client raises as APIError), and cancels the other choices. A wait of `keepalive`
    seconds without an event sends a `: keep-alive` comment (clients ignore comments; proxies see
    a live stream)."""
    replay = deque(early)
    stats: list[dict] = [{} for _ in choices]
    left = len(choices)
    while left:
        if replay:
            index, item = replay.popleft()
        else:
            try:
                index, item = await asyncio.wait_for(merge.next(), keepalive)
            except asyncio.TimeoutError:
                yield KEEPALIVE
                continue
        if isinstance(item, Failed):
            merge.cancel()  # one choice failing fails the request: the others stop too
            yield sse_error(item.error)
            break
        for chunk in choices[index].opening(item) if isinstance(item, Started) else choices[index].chunks(item):
            yield sse_data(chunk)
        if isinstance(item, StreamEvent) and item.finish_reason is not None:
            stats[index] = item.stats or {}
            left -= 1
    else:
        if include_usage:
            yield sse_data(fmt.usage_chunk(usage_of(stats)))
    yield DONE
