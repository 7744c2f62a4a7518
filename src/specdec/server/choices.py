"""The `n` choices of one request, and the log-probabilities they carry, in OpenAI's shapes.

Each choice is a generation request of its own in the scheduler (convert.py choice_requests);
`TicketMerge` reads their items as they come, tagged with the choice's index. The engine gives
log-probabilities as TokenLogprob entries (sampling/logprobs.py); the functions here turn them
into chat's `{"content": [...]}` or the legacy completions' parallel lists.
"""
from __future__ import annotations

import asyncio
import codecs
from collections import deque
from typing import Callable, Optional, Sequence, Union

from specdec.server.protocol import (
    ChatTokenLogprob, ChoiceLogprobs, PromptTokensDetails, TextLogprobs, TopLogprob, Usage,
)
from specdec.server.errors import RawJSON, json_text
from specdec.server.tickets import CLIENT_GONE, Failed, Item, Ticket, is_final
from specdec.types import TokenLogprob

TokenBytes = Callable[[int], bytes]


def token_text(data: bytes) -> str:
    # A token may end inside a UTF-8 character: its text then shows U+FFFD, its `bytes` the truth.
    return data.decode("utf-8", errors="replace")


class ChatLogprobBuilder:
    """One chat choice's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""

    def __init__(self, token_bytes: TokenBytes):
        self._token_bytes = token_bytes

    def build(self, entries: Sequence[TokenLogprob], token_ids: Sequence[int]) -> ChoiceLogprobs:
        content = []
        for token, entry in zip(token_ids, entries):
            data = self._token_bytes(token)
            content.append(ChatTokenLogprob(token=token_text(data), logprob=entry.logprob, bytes=list(data),
                                            top_logprobs=[self._top(t, lp) for t, lp in entry.top]))
        return ChoiceLogprobs(content=content)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        data = self._token_bytes(token)
        return TopLogprob(token=token_text(data), logprob=logprob, bytes=list(data))


class TextLogprobBuilder:
    """One completions choice's `logprobs`: `text_offset` runs on from chunk to chunk."""

    def __init__(self, token_bytes: TokenBytes):
        self._token_bytes = token_bytes
        self.offset = 0  # characters of the choice's text before the next token

    def build(self, entries: Sequence[Optional[TokenLogprob]], token_ids: Sequence[int]) -> TextLogprobs:
        """`entries[i]` for `token_ids[i]`; None for a token with no log-probability (the first of
        an echoed prompt)."""
        tokens: list[str] = []
        logprobs: list[Optional[float]] = []
        tops: list[Optional[dict[str, float]]] = []
        offsets: list[int] = []
        for token, entry in zip(token_ids, entries):
            text = token_text(self._token_bytes(token))
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(entry.logprob)
            # OpenAI's legacy rule: the chosen token is always listed, so up to logprobs + 1 entries.
            top = {token_text(self._token_bytes(t)): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)
            tops.append(top)
        return TextLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets)


# Tokens whose logprobs are built and encoded at a time, for an answer that is not streamed.
DUMP_TOKENS = 64
Columns = dict[str, list[str]]  # a logprobs object's fields, each as pieces of its list's JSON text


def logprob_columns(builder: Union[ChatLogprobBuilder, TextLogprobBuilder], entries: Sequence[Optional[TokenLogprob]],
                    token_ids: Sequence[int]) -> Columns:
    """What `builder.build(entries, token_ids)` is as JSON, a field at a time, built and encoded
    DUMP_TOKENS tokens at a time (on a worker thread: serving.respond): pydantic-core and the JSON
    encoder hold the GIL through each call, and an answer held as thousands of small objects
    makes every full garbage collection meanwhile walk them all, holding the GIL too. Every field
    of either shape is a list with an item per token (the text builder's offsets run on)."""
    columns: Columns = {}
    for start in range(0, max(len(token_ids), 1), DUMP_TOKENS):
        # arg-type: None entries (an echoed prompt's first token) go only to the text builder
        part = builder.build(entries[start:start + DUMP_TOKENS], token_ids[start:start + DUMP_TOKENS])  # type: ignore[arg-type]
        for name, values in part.model_dump(mode="json").items():
            column = columns.setdefault(name, [])
            if values:
                column.append(json_text(values)[1:-1])  # the items comma-separated, without the brackets
    return columns


def logprobs_json(*parts: Columns) -> RawJSON:
    """The logprobs object whose every list is the parts' lists one after the other (an echoed
    prompt's, then its completion's), as JSON text."""
    names = list(parts[0])
    fields = [f"{json_text(name)}:[{','.join(piece for part in parts for piece in part[name])}]" for name in names]
    return RawJSON("{" + ",".join(fields) + "}")


class LogprobQueue:
    """Which tokens' entries go with a streamed chunk: those whose text the chunks so far have
    completed. A token whose text is held back (a possible stop string) or ends inside a UTF-8
    character waits for the chunk that carries its text; `rest()` empties it at the end."""

    def __init__(self, token_bytes: TokenBytes):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoded = 0  # characters the tokens so far decode to
        self._streamed = 0  # characters of text streamed so far
        self._pending: deque[tuple[int, TokenLogprob]] = deque()  # (where its text ends, entry)

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob]) -> None:
        for token, entry in zip(token_ids, entries):
            self._decoded += len(self._decoder.decode(self._token_bytes(token)))
            self._pending.append((self._decoded, entry))

    def take(self, text: str) -> list[TokenLogprob]:
        self._streamed += len(text)
        taken = []
        while self._pending and self._pending[0][0] <= self._streamed:
            taken.append(self._pending.popleft()[1])
        return taken

    def rest(self) -> list[TokenLogprob]:
        taken = [entry for _, entry in self._pending]
        self._pending.clear()
        return taken


class TicketMerge:
    """The items of every choice's ticket, in the order they arrive, as (choice index, item)."""

    def __init__(self, tickets: Sequence[Ticket]):
        self.tickets = list(tickets)
        self._queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    async def next(self) -> tuple[int, Item]:
        if not self._pumps:
            self._pumps = [asyncio.create_task(self._pump(i, t)) for i, t in enumerate(self.tickets)]
        return await self._queue.get()

    async def _pump(self, index: int, ticket: Ticket) -> None:
        while True:
            item = await ticket.next()
            self._queue.put_nowait((index, item))
            if is_final(item):
                return

    def cancel(self) -> None:
        """Cancel every choice (a no-op for those finished) and stop reading: a reader still waiting
        in `next()` (an answer not streamed, its client gone) gets the client's going as a failure."""
        for ticket in self.tickets:
            ticket.cancel()
        for pump in self._pumps:
            pump.cancel()
        self._queue.put_nowait((0, Failed(CLIENT_GONE)))


def usage_of(stats: Sequence[dict]) -> Usage:
    """One usage for all choices: the prompt counted once, every choice's completion tokens; the
    speculative block is the one choice's statistics, or per choice under `per_choice`."""
    first = stats[0]
    prompt = first.get("prompt_tokens", 0)
    completion = sum(each.get("generated_tokens", 0) for each in stats)
    speculative = first if len(stats) == 1 else {"per_choice": list(stats)}
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=first.get("cached_prompt_tokens", 0)),
                 speculative=speculative)


def usage_of_prompts(stats: Sequence[dict], n: int) -> Usage:
    """One usage for a request of several prompts (completions), each with `n` choices in a row:
    each prompt counted once; the speculative block per prompt under `per_prompt`."""
    usages = [usage_of(stats[i:i + n]) for i in range(0, len(stats), n)]
    if len(usages) == 1:
        return usages[0]
    prompt = sum(usage.prompt_tokens for usage in usages)
    completion = sum(usage.completion_tokens for usage in usages)
    cached = sum(usage.prompt_tokens_details.cached_tokens for usage in usages if usage.prompt_tokens_details)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 speculative={"per_prompt": [usage.speculative for usage in usages]})
