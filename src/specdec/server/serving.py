"""The serving core that every API surface uses (chat and text completions, infill, Responses,
Messages): admission, the tenant, the queue bound and its 429, tokenizing off the event loop
within the time limit, cancellation when the client goes away, the answer streamed (keep-alive,
one failure event) or whole (built and encoded off the loop, in pieces), and the header naming
ignored fields.

A surface only translates: its wire request into engine requests (`prepare`), and engine items
into its wire format (a `StreamWriter` for streams, a function of the collected choices for a
whole answer). Its error shape is chosen by its path (errors.py).
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import quote
from typing import AsyncIterator, Awaitable, Callable, Literal, Optional, Protocol, Sequence, Union, cast

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from specdec.drafters.history import UNSHARED_TENANT
from specdec.engine.engine import Engine
from specdec.server.choices import TicketMerge
from specdec.server.config import ServerConfig
from specdec.server.drain import Drain
from specdec.server.errors import APIError, json_response
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Scheduler
from specdec.server.sse import EventStreamResponse
from specdec.server.offload import off_loop
from specdec.server.tenants import tenant_of_scope
from specdec.server.tickets import Failed, Item, QueueFull, Refused, Started, queue_timeout_error
from specdec.types import GenerationRequest, StreamEvent

IGNORED_HEADER = "X-Specdec-Ignored-Fields"
MAX_IGNORED_NAMED = 32  # names in the header; a body of thousands of unknown keys must not make a huge header
MAX_IGNORED_NAME = 128


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


def tenant_of(request: Request) -> Optional[str]:
    """Whose cross-request history a request drafts from and adds to: the tenant of its
    authenticated key (tenants.py), never a bearer string nobody checked. Without keys: nobody's
    (an empty history of its own), or with --shared-history the one anonymous history (None)."""
    tenant = tenant_of_scope(request.scope)
    if tenant is not None:
        return tenant
    return None if state_of(request).config.shared_history else UNSHARED_TENANT


def queue_full_error(retry_after: int) -> APIError:
    return APIError(429, "the server is at capacity: every slot is busy and the queue is full; retry later.",
                    "rate_limit_error", None, "queue_full", {"Retry-After": str(retry_after)})


# -- unknown fields ------------------------------------------------------------------------------
def ignored_fields(model: BaseModel) -> list[str]:
    """The names of the fields a request sent that no wire type declares, at every level, list
    positions folded (`messages[].cache_control`), each once, in the order met."""
    found: dict[str, None] = {}
    stack: list[tuple[object, str]] = [(model, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, BaseModel):
            for name in value.model_extra or ():
                found.setdefault(f"{path}{name}", None)
            children = [(getattr(value, name), f"{path}{name}") for name in type(value).model_fields]
            stack.extend((child, f"{where}.") for child, where in reversed(children))
        elif isinstance(value, (list, tuple)):
            base = path[:-1] if path.endswith(".") else path
            stack.extend((item, f"{base}[].") for item in reversed(value))
        elif isinstance(value, dict):
            continue  # free-form objects (schemas, metadata) have no declared fields
    return list(found)


def ignored_header(names: Sequence[str]) -> dict[str, str]:
    """The header naming ignored fields; a name is percent-encoded past [A-Za-z0-9_.[]-] (a header
    is latin-1, and a field name must not write another header line)."""
    if not names:
        return {}
    shown = [quote(name[:MAX_IGNORED_NAME], safe="[]._-") or '""' for name in names[:MAX_IGNORED_NAMED]]
    if len(names) > MAX_IGNORED_NAMED:
        shown.append(f"... {len(names) - MAX_IGNORED_NAMED} more")
    return {IGNORED_HEADER: ", ".join(shown)}


# -- admission -----------------------------------------------------------------------------------
async def submit(request: Request, count: int, prepare: Callable[[Engine], list[GenerationRequest]],
                 precheck: Optional[Callable[[Engine], None]] = None) -> TicketMerge:
    """Queue the engine requests `prepare` makes (on a worker thread: templates, tokenizers and
    grammar checks take a while on long prompts, within the time limit), all or none, after
    `precheck` (cheap size checks, on the loop) and the queue bound have let them in."""
    state = state_of(request)
    config = state.config
    try:
        state.scheduler.reserve(count)  # before encoding a prompt nobody will generate from
        reserved = count
        try:
            engine = state.engine
            if precheck is not None:
                precheck(engine)
            with anyio.fail_after(config.request_timeout):
                requests = await off_loop(prepare, engine, tenant=tenant_of_scope(request.scope),
                                          abandon_on_cancel=True)
            held, reserved = reserved, 0  # submit_many gives the places back, whatever it raises
            tickets = state.scheduler.submit_many(requests, asyncio.get_running_loop(), reserved=held)
        finally:
            if reserved:
                state.scheduler.unreserve(reserved)
    except QueueFull:
        raise queue_full_error(config.retry_after) from None
    except Refused as refused:
        raise refused.error from None
    except TimeoutError:
        raise queue_timeout_error(config.request_timeout, config.retry_after) from None
    return TicketMerge(tickets)


# -- the answer ----------------------------------------------------------------------------------
class StreamWriter(Protocol):
    """A surface's event stream: bytes for each engine item, its ending, its one failure event."""

    def begin(self) -> list[bytes]: ...

    def item(self, index: int, item: Union[Started, StreamEvent]) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...

    def failure(self, error: APIError) -> list[bytes]: ...

    def keepalive(self) -> bytes: ...


@dataclass
class Collected:
    """One choice of an answer that is not streamed."""

    started: Optional[Started] = None
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    final: Optional[StreamEvent] = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def stats(self) -> dict:
        return (self.final.stats if self.final is not None else None) or {}


Observer = Callable[[int, Union[Started, StreamEvent]], None]


async def respond(request: Request, merge: TicketMerge, *, stream: bool,
                  writer: Callable[[], StreamWriter], whole: Callable[[list[Collected]], dict],
                  observe: Optional[Observer] = None, ignored: Sequence[str] = ()) -> Response:
    """The answer to a submitted request: a stream written by `writer()`, or the JSON `whole`
    makes of every choice collected (`observe` sees each item as it arrives). A failure before a
    stream starts (or while it waits only briefly) is an HTTP status; after, it is the writer's
    failure event."""
    config = state_of(request).config
    count = len(merge.tickets)
    headers = ignored_header(ignored)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, merge))
    streaming = False
    try:
        if stream:
            early = await _opening_items(merge, count, config.sse_keepalive)
            failed = next((item for _, item in early if isinstance(item, Failed)), None)
            if failed is not None:
                raise failed.error
            watcher.cancel()
            streaming = True
            response = EventStreamResponse(_stream(merge, writer(), config.sse_keepalive, early),
                                           on_close=merge.cancel, write_timeout=config.write_timeout)
            response.headers.update(headers)
            return response
        results = await collect(merge, count, observe)
        # A big answer (n choices with logprobs: tens of MB of JSON) is built and encoded on a worker
        # thread, in short pieces (errors.json_bytes) that let the event loop run between them.
        return await off_loop(lambda: json_response(whole(results), headers=headers or None),
                              tenant=tenant_of_scope(request.scope))
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


async def collect(merge: TicketMerge, count: int, observe: Optional[Observer] = None) -> list[Collected]:
    """Every choice to its end; a choice's failure is the request's."""
    results = [Collected() for _ in range(count)]
    left = count
    while left:
        index, item = await merge.next()
        if isinstance(item, Failed):
            raise item.error
        result = results[index]
        if observe is not None:
            observe(index, item)
        if isinstance(item, Started):
            result.started = item
            continue
        result.parts.append(item.text)
        result.token_ids.extend(item.token_ids)
        result.logprobs.extend(item.logprobs or ())
        if item.finish_reason is not None:
            result.final = item
            left -= 1
    return results


async def _opening_items(merge: TicketMerge, count: int, wait: float) -> list[tuple[int, Item]]:
    """The items that arrive within `wait` seconds, until every choice has started or one failed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    items: list[tuple[int, Item]] = []
    started: set[int] = set()
    while len(started) < count and loop.time() < deadline:
        try:
            index, item = await asyncio.wait_for(merge.next(), deadline - loop.time())
        except asyncio.TimeoutError:
            break
        items.append((index, item))
        if isinstance(item, Failed):
            break
        started.add(index)
    return items


async def _stream(merge: TicketMerge, writer: StreamWriter, keepalive: float,
                  early: Sequence[tuple[int, Item]] = ()) -> AsyncIterator[bytes]:
    """Every choice's items as the writer writes them, as they come; `early`: items read before the
    response started. A failure after the stream started cannot change the HTTP status: it ends
    the stream with the writer's failure event and cancels the other choices. A wait of
    `keepalive` seconds without an item sends the writer's keep-alive."""
    for chunk in writer.begin():
        yield chunk
    replay = deque(early)
    left = len(merge.tickets)
    while left:
        if replay:
            index, item = replay.popleft()
        else:
            try:
                index, item = await asyncio.wait_for(merge.next(), keepalive)
            except asyncio.TimeoutError:
                yield writer.keepalive()
                continue
        if isinstance(item, Failed):
            merge.cancel()  # one choice failing fails the request: the others stop too
            for chunk in writer.failure(item.error):
                yield chunk
            return
        for chunk in writer.item(index, item):
            yield chunk
        if isinstance(item, StreamEvent) and item.finish_reason is not None:
            left -= 1
    for chunk in writer.end():
        yield chunk


EndReason = Literal["stop", "length"]  # a finished choice's finish_reason, as clients see it


def finish_reason_of(event: StreamEvent) -> EndReason:
    # "cancelled" reaches a client only when the server's time limit cut the generation.
    # cast: a final event's finish_reason is the engine's "stop", "length" or "cancelled"
    return "length" if event.finish_reason == "cancelled" else cast(EndReason, event.finish_reason)
