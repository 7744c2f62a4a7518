"""OpenAI's chat and text completions as a surface of the serving core (serving.py): their
wire requests into engine requests (convert.py), engine items into chunks and answers.

A completions request with a list of prompts is one engine request per prompt and choice:
choice `i * n + j` is prompt i's choice j, as OpenAI numbers them.
"""
from __future__ import annotations

import time
import uuid
from typing import Callable, Literal, Optional, Sequence, Union, cast

from fastapi import Request
from starlette.responses import Response

from specdec.drafters.registry import HISTORY_SOURCES
from specdec.engine.engine import Engine
from specdec.server.choices import (
    ChatLogprobBuilder, Columns, LogprobQueue, TextLogprobBuilder, logprob_columns, logprobs_json, usage_of_prompts,
)
from specdec.server.convert import (
    check_model, check_prompt_size, check_unstreamed_size, choice_requests, encode_prompt, generation_request,
    logprob_entries, prompts_of,
)
from specdec.server.pieces import TokenPieces
from specdec.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, StreamOptions, TextLogprobs, Usage,
)
from specdec.server.serving import (
    Collected, EndReason, finish_reason_of, ignored_fields, respond, state_of, submit, tenant_of,
)
from specdec.server.speculative import SourceAnnotator, wants_rejected
from specdec.server.sse import DONE, KEEPALIVE, sse_data, sse_error
from specdec.server.errors import APIError, RawJSON
from specdec.server.tickets import Started
from specdec.server.tools import ToolCallDelta, ToolStreamParser, calls_finish_reason, parse_output, tool_names
from specdec.types import GenerationRequest, StreamEvent, TokenLogprob

Body = Union[ChatCompletionRequest, CompletionRequest]
ChatEndReason = Union[EndReason, Literal["tool_calls"]]  # the model called tools


async def complete(request: Request, body: Body) -> Response:
    """POST /v1/chat/completions and /v1/completions."""
    state = state_of(request)
    check_model(body.model, state.config)
    fmt: Format = (ChatFormat(state.config.served_model_name, tool_names(body))
                   if isinstance(body, ChatCompletionRequest) else TextFormat(state.config.served_model_name))
    n = body.n or 1  # each choice is a request of its own in the scheduler
    prompts = prompts_of(body)
    tenant = tenant_of(request)
    encoded: list[list[int]] = []

    def prepare(engine: Engine) -> list[GenerationRequest]:
        requests = []
        entries = 0  # log-probability entries the whole answer may hold
        for prompt in prompts:
            ids = encode_prompt(engine, prompt)
            encoded.append(ids)
            first = generation_request(engine, state.config, prompt, ids, tenant)
            entries += n * logprob_entries(first, engine.target.n_ctx)
            requests += choice_requests(first, n)
        if not body.stream:
            check_unstreamed_size(state.config, entries,
                                  "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs")
        return requests

    def precheck(engine: Engine) -> None:
        for prompt in prompts:
            check_prompt_size(engine, state.config, prompt)

    merge = await submit(request, n * len(prompts), prepare, precheck)
    engine = state.engine
    token_bytes = engine.target.token_bytes
    logprobs = merge.tickets[0].request.logprobs is not None
    echoes = [_echo(engine, prompt, ids) for prompt, ids in zip(prompts, encoded)]

    def writer() -> CompletionStream:
        options = body.stream_options
        choices = [StreamChoice(index, fmt, token_bytes, logprobs=logprobs, echo=echoes[index // n],
                                pieces=TokenPieces(token_bytes) if state.config.stream_one_token_per_chunk else None,
                                annotator=annotator_for(request, options))
                   for index in range(len(merge.tickets))]
        scored = logprobs and any(echo is not None for echo in echoes)
        return CompletionStream(fmt, choices, bool(options and options.include_usage), n, scored)

    return await respond(request, merge, stream=bool(body.stream), writer=writer,
                         whole=lambda results: _response(fmt, results, token_bytes, logprobs, echoes, n),
                         ignored=ignored_fields(body))


class ChatFormat:
    def __init__(self, model: str, tool_names: frozenset[str] = frozenset()):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tool_names = tool_names  # with tools, the output is read for their calls (tools.py)
        self.tool_calling = bool(tool_names)

    def response(self, text: str, finish_reason: ChatEndReason, usage: Usage) -> ChatCompletionResponse:
        message = ChatResponseMessage(content=text)
        if self.tool_calling:
            parsed = parse_output(text, self.tool_names)
            message = ChatResponseMessage(content=parsed.content, tool_calls=parsed.tool_calls or None)
            finish_reason = calls_finish_reason(finish_reason, len(parsed.tool_calls))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            ChatChoice(message=message, finish_reason=finish_reason)])

    def tool_parser(self) -> Optional[ToolStreamParser]:
        return ToolStreamParser(self.tool_names) if self.tool_calling else None

    def tool_chunk(self, delta: ToolCallDelta) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(tool_calls=[delta]))

    def opening(self) -> list[ChatCompletionChunk]:
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def chunk(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text))

    def closing(self, finish_reason: ChatEndReason) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), finish_reason)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    @staticmethod
    def logprobs_builder(token_bytes: Callable[[int], bytes]) -> ChatLogprobBuilder:
        return ChatLogprobBuilder(token_bytes)

    def _chunk(self, delta: ChatDelta, finish_reason: Optional[ChatEndReason] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])


class TextFormat:
    tool_calling = False

    def __init__(self, model: str):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def response(self, text: str, finish_reason: EndReason, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)])

    def tool_parser(self) -> None:
        return None

    def opening(self) -> list[CompletionResponse]:
        return []

    def chunk(self, text: str) -> CompletionResponse:
        return self._chunk(text)

    def closing(self, finish_reason: EndReason) -> CompletionResponse:
        return self._chunk("", finish_reason)

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    @staticmethod
    def logprobs_builder(token_bytes: Callable[[int], bytes]) -> TextLogprobBuilder:
        return TextLogprobBuilder(token_bytes)

    def _chunk(self, text: str, finish_reason: Optional[EndReason] = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)])


Format = Union[ChatFormat, TextFormat]


def _echo(engine: Engine, body: Body, prompt_ids: list[int]) -> Optional[tuple[str, list[int]]]:
    """Completions' `echo`: the prompt's text as sent (token ids sent: their text), and its ids."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return engine.target.detokenize(prompt_ids), prompt_ids
    # cast: text, as prompts_of splits a list of token lists into one prompt each
    return cast(str, prompt[0] if isinstance(prompt, list) else prompt), prompt_ids


def _response(fmt: Format, results: list[Collected], token_bytes: Callable[[int], bytes], logprobs: bool,
              echoes: Sequence[Optional[tuple[str, list[int]]]], n: int) -> dict:
    """The whole answer, ready for json_bytes (on a worker thread: serving.respond); each choice's
    logprobs built and encoded a slice of tokens at a time (choices.logprob_columns)."""
    usage = usage_of_prompts([result.stats for result in results], n)
    choices: list = []  # the format's ChatChoice or CompletionChoice
    encoded: list[RawJSON] = []  # each choice's logprobs, as JSON text
    prompts: dict[int, Columns] = {}  # each echoed prompt's logprobs, built once for its n choices
    response = None
    for index, result in enumerate(results):
        echo = echoes[index // n]
        prefix = echo[0] if echo is not None else ""
        assert result.final is not None
        response = fmt.response(prefix + result.text, finish_reason_of(result.final), usage)
        choice = response.choices[0]
        choice.index = index
        if logprobs:
            builder = fmt.logprobs_builder(token_bytes)
            parts = []
            if echo is not None:
                if index // n not in prompts:  # scored by the prompt's first choice (convert.choice_requests)
                    prompts[index // n] = _echo_columns(token_bytes, echo, results[index // n * n].started)
                parts.append(prompts[index // n])
                # cast: only a text completion echoes its prompt
                cast(TextLogprobBuilder, builder).offset = len(echo[0])
            parts.append(logprob_columns(builder, result.logprobs, [entry.token_id for entry in result.logprobs]))
            encoded.append(logprobs_json(*parts))
        choices.append(choice)
    assert response is not None
    response.choices = choices
    data = response.model_dump(mode="json")
    for dumped, text in zip(data["choices"], encoded):
        dumped["logprobs"] = text
    return data


def _prompt_entries(echo: tuple[str, list[int]], started: Optional[Started]) -> tuple[list, list[int]]:
    """The echoed prompt's logprob entries (its first token has none) and their tokens, as the
    prompt's first choice scored them for all its choices (convert.choice_requests)."""
    ids = echo[1]
    scored = started.prompt_logprobs if started is not None and started.prompt_logprobs is not None else []
    return [None, *scored], ids[:len(scored) + 1]


def _echo_columns(token_bytes: Callable[[int], bytes], echo: tuple[str, list[int]],
                  started: Optional[Started]) -> Columns:
    """The echoed prompt's logprobs, encoded."""
    return logprob_columns(TextLogprobBuilder(token_bytes), *_prompt_entries(echo, started))


def _echo_logprobs(builder: TextLogprobBuilder, echo: tuple[str, list[int]], started: Optional[Started]) -> TextLogprobs:
    """The echoed prompt's logprobs, streamed; the builder's offsets continue after it."""
    prompt = builder.build(*_prompt_entries(echo, started))
    builder.offset = len(echo[0])
    return prompt


def annotator_for(request: Request, options: Optional[StreamOptions]) -> Optional[SourceAnnotator]:
    """The `speculative` extension's annotator, when the request asked for it (speculative.py)."""
    rejected = wants_rejected(options)
    if rejected is None:
        return None
    token_bytes = state_of(request).engine.target.token_bytes
    # Tenant None: the history every anonymous client shares, whose text is theirs, not this one's.
    hidden = HISTORY_SOURCES if tenant_of(request) is None else frozenset()
    return SourceAnnotator(TokenPieces(token_bytes), token_bytes, rejected, hidden)


class StreamChoice:
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
        self.tools = fmt.tool_parser()  # content vs tool calls

    def opening(self, scored: Optional[Started] = None) -> list:
        """The choice's first chunks; `scored`: the Started of the choice that scored the prompt
        (its first), whose logprobs go with the echoed prompt."""
        chunks = list(self.fmt.opening())
        if self.echo is not None:
            chunk = self.fmt.chunk(self.echo[0])
            if self.builder is not None:
                # cast: only a text completion echoes its prompt
                chunk.choices[0].logprobs = _echo_logprobs(cast(TextLogprobBuilder, self.builder), self.echo, scored)
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
            finish_reason: ChatEndReason = finish_reason_of(event)
            if self.tools is not None:
                chunks += [self._tool_item(item) for item in self.tools.finish()]
                finish_reason = calls_finish_reason(finish_reason, self.tools.index)
            if self.queue is not None and (rest := self.queue.rest()):
                chunks.append(self._with_logprobs(self.fmt.chunk(""), rest))  # tokens whose text a stop string cut
            # cast: "tool_calls" comes only with tools, which only a chat format has
            closing = self.fmt.closing(cast(EndReason, finish_reason))
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
        return self.fmt.chunk(item) if isinstance(item, str) else self.fmt.tool_chunk(item)  # type: ignore[union-attr]

    def _chunk(self, text: str, update: Optional[dict] = None):
        chunk = self.fmt.chunk(text)
        if update:
            chunk = chunk.model_copy(update=update)
        return self._with_logprobs(chunk, self.queue.take(text)) if self.queue is not None else chunk

    def _with_logprobs(self, chunk, entries: list[TokenLogprob]):
        if entries and self.builder is not None:
            chunk.choices[0].logprobs = self.builder.build(entries, [entry.token_id for entry in entries])
        return chunk

    def _indexed(self, chunks: list) -> list:
        for chunk in chunks:
            for choice in chunk.choices:
                choice.index = self.index
        return chunks


class CompletionStream:
    """The completions stream (serving.StreamWriter): each choice's chunks from its role chunk (chat)
    or echoed prompt to its finish_reason chunk, then the usage chunk (stream_options.include_usage)
    and `data: [DONE]`. A failure is ONE error event, `data: {"error": {...}}` (OpenAI's shape, which
    the `openai` client raises as APIError), then `[DONE]`; a wait is a `: keep-alive` comment."""

    def __init__(self, fmt: Format, choices: list[StreamChoice], include_usage: bool, n: int, scored: bool = False):
        self.fmt, self.choices, self.include_usage, self.n = fmt, choices, include_usage, n
        self.stats: list[dict] = [{} for _ in choices]
        # `scored` (echo with logprobs): a prompt's first choice scores it for all; the others'
        # items wait here until its Started brings the prompt's logprobs.
        self.scorers: dict[int, Started] = {}  # prompt -> its first choice's Started
        self.held: Optional[dict[int, list[Union[Started, StreamEvent]]]] = {} if scored else None

    def begin(self) -> list[bytes]:
        return []

    def item(self, index: int, item: Union[Started, StreamEvent]) -> list[bytes]:
        prompt, first = divmod(index, self.n)
        if self.held is None:
            return self._written(index, item, item if isinstance(item, Started) else None)
        if first == 0 and isinstance(item, Started):
            self.scorers[prompt] = item
            written = self._written(index, item, item)
            for other in range(index + 1, index + self.n):
                for held in self.held.pop(other, []):
                    written += self._written(other, held, item)
            return written
        if prompt not in self.scorers:
            self.held.setdefault(index, []).append(item)
            return []
        return self._written(index, item, self.scorers[prompt])

    def _written(self, index: int, item: Union[Started, StreamEvent], scored: Optional[Started]) -> list[bytes]:
        choice = self.choices[index]
        if isinstance(item, Started):
            return [sse_data(chunk) for chunk in choice.opening(scored)]
        if item.finish_reason is not None:
            self.stats[index] = item.stats or {}
        return [sse_data(chunk) for chunk in choice.chunks(item)]

    def end(self) -> list[bytes]:
        # Items still held (a prompt's first choice ended without starting): without the prompt's logprobs.
        written = [data for index, items in sorted((self.held or {}).items()) for item in items
                   for data in self._written(index, item, None)]
        if not self.include_usage:
            return [*written, DONE]
        return [*written, sse_data(self.fmt.usage_chunk(usage_of_prompts(self.stats, self.n))), DONE]

    def failure(self, error: APIError) -> list[bytes]:
        return [sse_error(error), DONE]

    def keepalive(self) -> bytes:
        return KEEPALIVE
