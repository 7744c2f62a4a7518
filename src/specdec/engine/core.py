"""The engine core: the one driver of decode rounds, for every caller.

`specdec generate` and `specdec bench` drive it with one request at a time, the server's
scheduler and each Ray replica with as many as there are slots; all of them the same way:

    handle = core.add(request)      # into the free slot whose cache shares most of its prompt
    for handle, item in core.step():   # one round for every request in a slot
        ...                         # Started, then StreamEvents (the last has finish_reason), or Failed
    core.abort(handle)              # the client went away or its time is up

One `step()` admits the requests added since the last one (reusing the cached prefix of their
prompts, from their own slot's cache or, where the backend shares cached positions, any slot's of
the same tenant: a request whose prompt start another is still processing waits for it instead of
computing it too, as the choices of an `n` > 1 request do), processes up to `prefill_budget`
prompt tokens in whole aligned chunks, the prompts with the fewest left first (a long prompt
joining does not stall the others), then
asks every started generation for its plan (pending token + drafts; the draft model's forwards of
all their proposals run together, one per draft position) and verifies them all in ONE target
forward, timed here and nowhere else.
A request's failure is its own (its slot is reset); a failed shared forward fails those in it.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Optional, Union

from specdec.backends.sequence import CachedSequence, common_prefix_length
from specdec.drafters import registry as drafting_methods
from specdec.drafters.base import DraftForward, DraftReply
from specdec.engine.decoder import Generation
from specdec.engine.prompt_cache import Parked, Saved
from specdec.sampling.logprobs import token_logprobs
from specdec.types import GenerationRequest, GenerationResult, SpecdecError, StreamEvent, TokenLogprob

if TYPE_CHECKING:
    from specdec.engine.engine import Engine

logger = logging.getLogger("specdec.engine")

DEFAULT_PREFILL_BUDGET = 512  # prompt tokens per step, for every prompt being processed together
# Steps a prompt may be passed over for shorter ones before it goes first (_prefill): short prompts
# jump the queue, a long one is never starved by them.
PREFILL_PATIENCE = 4
# Prompt tokens per step scored with logits (echo): they go through decode-sized forwards, far
# slower per token than prompt processing, so fewer per step keep the other streams moving.
SCORING_BUDGET = 64


@dataclass(frozen=True)
class Started:
    """The prompt is processed; tokens follow."""

    prompt_tokens: int
    cached_prompt_tokens: int
    # With GenerationRequest.prompt_logprobs: the entries of prompt tokens 1.. (the first has none)
    prompt_logprobs: Optional[list[TokenLogprob]] = None


@dataclass(frozen=True)
class Failed:
    """The request ended with an error: `error` is a SpecdecError for bad input, anything else
    for a failure of ours."""

    error: BaseException

    @property
    def bad_input(self) -> bool:
        return isinstance(self.error, SpecdecError)


Item = Union[Started, StreamEvent, Failed]


class NoFreeSlot(Exception):
    """add() was called while every slot is busy: the caller keeps its own queue."""


@dataclass
class _Active:
    request: GenerationRequest
    slot: int
    added_at: float
    generation: Optional[Generation] = None  # None until admitted
    started: bool = False
    prompt_logprobs: Optional[list[TokenLogprob]] = None  # scored so far; None: not asked for
    scoring: bool = False  # the prompt's scoring pass is under way (see _score_chunk)
    placed: bool = False  # _gather has seen where its cached start lies
    passed_over: int = 0  # steps in a row its prompt got no tokens while others' did (_prefill)

    @property
    def admitted(self) -> Generation:
        """The generation, for the stages that run only after admission (`_begin`) made it."""
        if self.generation is None:
            raise AssertionError("a request's stage ran before its admission")
        return self.generation


class EngineCore:
    def __init__(self, engine: "Engine", clock: Optional[Callable[[], float]] = None):
        self.engine = engine
        self.clock = clock or engine.clock
        self._active: dict[int, _Active] = {}  # handle -> its request, in admission order
        self._last_used = [0.0] * len(engine.slots)
        # Whose text each slot's cache holds: a prefix is reused only for the same tenant, so no
        # request learns (cached_tokens, or timing) what another tenant's prompt began with.
        self._slot_tenant: list[Optional[str]] = [None] * len(engine.slots)
        self._handles = itertools.count(1)
        # What the current step is doing, read by a watchdog on another thread ("" when idle).
        self.stage = ""
        self._drafting: set[int] = set()  # the handles whose plans ran draft-model forwards last round

    # -- the interface -----------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self.engine.slots) - len(self._active)

    @property
    def busy(self) -> bool:
        return bool(self._active)

    @property
    def busy_slots(self) -> list[int]:
        return sorted(active.slot for active in list(self._active.values()))

    def add(self, request: GenerationRequest) -> int:
        """Take a request into a free slot (it starts at the next step); returns its handle."""
        if not self.free_slots:
            raise NoFreeSlot()
        taken = {active.slot for active in self._active.values()}
        free = [i for i in range(len(self.engine.slots)) if i not in taken]
        slot = max(free, key=lambda i: (self._reusable(i, request), -self._last_used[i]))
        handle = next(self._handles)
        self._active[handle] = _Active(request, slot, self.clock())
        return handle

    def abort(self, handle: int) -> Optional[StreamEvent]:
        """End a request now and free its slot; its final event (the text so far, finish_reason
        "cancelled", its stats) if its generation had started, else None."""
        active = self._active.pop(handle, None)
        if active is None:
            return None
        self._last_used[active.slot] = self.clock()
        if active.started and active.generation is not None and not active.generation.finished:
            return active.generation.cancel()
        return None

    def reset(self) -> None:
        """Forget every slot's caches (after a stuck backend call returned: their state is not trusted)."""
        for index in range(len(self.engine.slots)):
            self._reset_slot(index)
        for cache in (self.engine.prompt_cache, self.engine.draft_copies):
            if cache is not None:
                cache.clear()

    def stats_of(self, handle: int) -> dict:
        """A running request's statistics so far ({} if it has none); safe to call from another
        thread while a step is stuck in a backend call."""
        active = self._active.get(handle)
        try:
            return active.generation.stats.as_dict() if active and active.generation else {}
        except RuntimeError:  # changed under us
            return {}

    def step(self, prefill_budget: int = DEFAULT_PREFILL_BUDGET, batched: bool = True) -> list[tuple[int, Item]]:
        """One round for every request in a slot. `batched`: every generation's plan in one target
        forward; else one forward each (for backends whose batched logits are not exact)."""
        items: list[tuple[int, Item]] = []
        try:
            self.stage = "admitting"
            for handle, active in list(self._active.items()):
                if active.generation is None:
                    self._guarded(items, handle, self._begin, active)
            self.stage = "prompt processing"
            self._prefill(items, prefill_budget)
            self.stage = "decoding"
            self._decode(items, batched)
        finally:
            self.stage = ""
        for handle, item in items:
            if isinstance(item, Failed) or (isinstance(item, StreamEvent) and item.finish_reason is not None):
                self._release(handle)
        return items

    # -- one caller at a time, to the end --------------------------------------------------------
    def stream(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        """One request driven alone to its end: its events; a failure is raised."""
        handle = self.add(request)
        try:
            while True:
                for _, item in self.step():
                    if isinstance(item, Failed):
                        raise item.error
                    if isinstance(item, StreamEvent):
                        yield item
                        if item.finish_reason is not None:
                            return
        finally:
            self.abort(handle)  # a no-op once finished; frees the slot if the caller stopped early

    def generate(self, request: GenerationRequest) -> GenerationResult:
        text, token_ids = [], []
        for event in self.stream(request):
            text.append(event.text)
            token_ids.extend(event.token_ids)
            if event.finish_reason is not None:
                return GenerationResult("".join(text), token_ids, event.finish_reason, event.stats or {})
        raise AssertionError("generation ended without a final event")

    # -- stages ------------------------------------------------------------------------------
    def _may_reuse(self, slot: int, request: GenerationRequest) -> bool:
        """Whether the request may start from what the slot's cache holds: its own tenant's text,
        and it did not ask for its whole prompt to be processed."""
        # A request scoring its prompt needs every prompt row's logits: nothing of the cache serves it.
        return self._slot_tenant[slot] == request.tenant and self._may_reuse_cache(request)

    @staticmethod
    def _may_reuse_cache(request: GenerationRequest) -> bool:
        """Whether the request may start from any cached text of its tenant's (see _may_reuse)."""
        return request.cache_prompt and request.prompt_logprobs is None

    def _reusable(self, slot: int, request: GenerationRequest) -> int:
        if not self._may_reuse(slot, request):
            return 0
        return self.engine.slots[slot].target.reusable_prefix(request.prompt_token_ids[:-1])

    def _begin(self, active: _Active) -> None:
        engine = self.engine
        active.generation = engine.new_generation(active.request, slot=active.slot)
        slot = engine.slots[active.slot]
        self._park(active)
        self._copy_draft(active)
        if engine.config.prefix_cache and self._may_reuse(active.slot, active.request):
            active.admitted.cached_prompt_tokens = slot.target.reuse_prefix(active.request.prompt_token_ids[:-1])
        else:  # another tenant's text, or a request that asked for none: nothing of it is reused
            slot.target.clear()
            if slot.draft is not None:
                slot.draft.clear()
        self._slot_tenant[active.slot] = active.request.tenant
        self._load_draft(active)
        if active.request.prompt_logprobs is not None:
            active.prompt_logprobs, active.scoring = [], True

    @property
    def slot_tenants(self) -> list[Optional[str]]:
        """The tenant whose text each slot holds (None: anonymous, or nothing)."""
        return list(self._slot_tenant)

    def _park(self, active: _Active) -> None:
        """Keep what the slot holds in the prompt cache (prompt_cache.py) where the request would
        drop some of it: another conversation takes the slot. Parking costs the request what it
        keeps past its last whole block (keepable: that block is the parked start's too), so
        where it keeps some, only if the slot drops a block's worth more."""
        cache, sequence = self.engine.prompt_cache, self.engine.slots[active.slot].target
        if cache is None or not sequence.tokens:
            return
        keep, block = self._reusable(active.slot, active.request), self.engine.target.prefix_share_block
        dropped = sequence.reusable_end - keep  # what a longer prompt could reuse that the request does not
        if dropped > 0 and (keep % block == 0 or dropped >= block):
            try:
                cache.park(sequence, self._slot_tenant[active.slot])
            except Exception:  # a start not kept costs its reprocessing later, never this request
                logger.exception("could not park slot %d's prompt start", active.slot)

    def _copy_draft(self, active: _Active) -> None:
        """Copy the draft model's sequence in the slot to host memory where the request would drop
        a block's worth of it: the conversation it served may come back (_load_draft)."""
        copies, draft = self.engine.draft_copies, self.engine.slots[active.slot].draft
        if copies is None or draft is None or not draft.tokens:
            return
        keep = draft.reusable_prefix(active.request.prompt_token_ids[:-1]) if self._may_reuse(active.slot, active.request) else 0
        if len(draft.tokens) - keep >= self.engine.target.prefix_share_block:
            try:
                copies.copy(draft, self._slot_tenant[active.slot])
            except Exception:  # a copy not kept costs the draft's catch-up later, never this request
                logger.exception("could not copy slot %d's draft sequence", active.slot)

    def _load_draft(self, active: _Active) -> None:
        """The draft model's copy of this conversation, where one of its tenant's serves a block's
        worth more of the prompt than the slot's draft holds: its proposals then need no catch-up
        on the prompt (the draft's values change which tokens are proposed, never the output)."""
        copies, draft = self.engine.draft_copies, self.engine.slots[active.slot].draft
        if copies is None or draft is None or not self._may_reuse_cache(active.request) \
                or not drafting_methods.wants_draft(active.request.spec.method):
            return  # a method that never runs the draft model does not need its cache loaded
        prefix = active.request.prompt_token_ids[:-1]
        entry, length = copies.best(active.request.tenant, prefix)
        if entry is not None and length - draft.reusable_prefix(prefix) >= self.engine.target.prefix_share_block:
            copies.restore(entry, draft, length)

    def _make_room(self, seq_id: int, end: int) -> None:
        """Parked prompt starts give way, least recently used first, to a sequence that needs cells."""
        cache, target = self.engine.prompt_cache, self.engine.target
        while cache is not None and not target.has_room(seq_id, end) and cache.evict_one():
            pass

    def _room_to_hold(self, seq_id: int, source_seq: int, length: int, end: int, sparing: Optional[Parked] = None) -> bool:
        """Whether seq_id, holding source_seq's positions < length, will have room for its
        positions < end; parked prompt starts but `sparing` give way, least recently used first."""
        cache, target = self.engine.prompt_cache, self.engine.target
        while not target.room_to_hold(seq_id, source_seq, length, end):
            if cache is None or not cache.evict_one(sparing):
                return False
        return True

    def _expected_end(self, request: GenerationRequest) -> int:
        """Where the request's positions end if it generates all it may."""
        n_ctx, most = self.engine.target.n_ctx, request.max_tokens
        return min(n_ctx, len(request.prompt_token_ids) + (n_ctx if most is None else most))

    def _prefill(self, items: list, budget: int) -> None:
        """The prompts with the fewest tokens left go first, whatever order they came in: a short
        prompt's first token does not wait behind a long one, and requests that arrive together
        are processed in the same order every time. One passed over PREFILL_PATIENCE steps goes
        first (in admission order), so a stream of short prompts never starves a long one."""
        ready = []
        for handle, active in list(self._active.items()):
            if active.started or active.generation is None:
                continue
            waits = self._guarded(items, handle, self._share_prompt_start, handle, active)
            if waits or self._failed(items, handle):
                continue  # waits: an earlier request is processing the start of this prompt
            ready.append((handle, active))
        ready.sort(key=lambda entry: self._prefill_rank(entry[1]))
        for handle, active in ready:
            processed = self._guarded(items, handle, self._prefill_chunk, active, budget) if budget > 0 else 0
            budget -= processed or 0
            active.passed_over = 0 if processed else active.passed_over + 1
            if not self._failed(items, handle) and self._prompt_done(active):
                items.extend((handle, item) for item in self._guarded(items, handle, self._start, active) or ())

    def _share_prompt_start(self, handle: int, active: _Active) -> bool:
        """Take the longest start of this request's prompt that another slot has computed or a
        parked one holds (the same tenant's), if the rest will have room above it; True if an
        earlier request is computing a longer one, to wait for it."""
        share = self.engine.target.prefix_share_block
        if not share or active.scoring or not self.engine.config.prefix_cache:
            return False
        prefix = active.request.prompt_token_ids[:-1]
        own = self.engine.slots[active.slot].target
        sources = [i for i in range(len(self.engine.slots)) if i != active.slot and self._may_reuse(i, active.request)]
        best, source = len(own.tokens), None
        for i in sources:
            length = self.engine.slots[i].target.shareable_prefix(prefix)
            if length > best:
                best, source = length, i
        cache = self.engine.prompt_cache
        parked, length = cache.best(active.request.tenant, prefix) \
            if cache is not None and self._may_reuse_cache(active.request) else (None, 0)
        # The longest start first: a parked one, another slot's, this slot's own, none. A sequence's
        # blocks only rise, so a start is taken only if the rest of the prompt and the answer will
        # find blocks above it; processed from scratch, they may sit in free blocks below. If none
        # has room, the longest still held is taken: the request fails alone if it gets that far.
        options: list[tuple[CachedSequence, int, Union[Parked, Saved, None]]] = []
        if parked is not None and length > best:
            options.append((parked.sequence if isinstance(parked, Parked) else own, length, parked))
        if source is not None:
            options.append((self.engine.slots[source].target, best, None))
        options += [(own, len(own.tokens), None), (own, 0, None)]
        end = self._expected_end(active.request)

        def has_room(option: tuple[CachedSequence, int, Union[Parked, Saved, None]]) -> bool:
            holder, length, entry = option
            if isinstance(entry, Saved):  # loaded into cells of the request's own: room as for none held
                return self._room_to_hold(own.seq_id, own.seq_id, 0, end)
            return self._room_to_hold(own.seq_id, holder.seq_id, length, end, sparing=entry)

        chosen = next((option for option in options if has_room(option)), None)
        if chosen is None:  # every parked start was dropped looking for room
            chosen = next(option for option in options if option[2] is None)
        holder, length, entry = chosen
        if cache is not None and entry is not None:
            active.admitted.cached_prompt_tokens = cache.restore(entry, own, length)
        elif holder is not own:
            own.adopt(holder, length)
            active.admitted.cached_prompt_tokens = length
        elif length < len(own.tokens):
            own.clear()
            active.admitted.cached_prompt_tokens = 0
        if entry is not None or not active.placed:  # once, and again for a start taken later
            active.placed = True
            self._gather(own, active, end)
        # Waiting pays when the earlier request will compute at least one more block we can take.
        unit = math.lcm(share, own.alignment)
        for other_handle, other in self._active.items():
            if other_handle == handle:
                return False  # only earlier requests: no two wait for each other
            if other.started or other.generation is None or other.scoring or other.slot not in sources:
                continue
            common = common_prefix_length(other.request.prompt_token_ids[:-1], prefix)
            if common // unit * unit > len(own.tokens):
                return True
        return False

    def _gather(self, own: CachedSequence, active: _Active, end: int) -> None:
        """Move the start the slot holds into blocks that lie together where it lies among others'
        (Backend.gather); one that fails to move is processed again, never failing the request."""
        cache = self.engine.prompt_cache
        try:
            if own.gather(end) and cache is not None:
                cache.stats.gathered += 1
        except Exception:
            logger.exception("could not move slot %d's cached prompt start; processing it again", active.slot)
            active.admitted.cached_prompt_tokens = 0

    def _score_chunk(self, active: _Active, budget: int) -> int:
        """Up to `budget` more prompt tokens evaluated with logits, for the prompt's log-probabilities.
        Once all are, the cache is emptied and the prompt processed as any other request's, so the
        text generated is what it would be without them (logits-returning forwards fill the cache
        with values of their own on an exact backend)."""
        prompt, scored, top = active.request.prompt_token_ids, active.prompt_logprobs, active.request.prompt_logprobs
        if scored is None or top is None:
            raise AssertionError("scoring a prompt whose log-probabilities were not asked for")
        target = self.engine.slots[active.slot].target
        done = len(target.tokens)
        end = min(len(prompt) - 1, done + min(budget, SCORING_BUDGET))
        if end > done:  # row j gives the distribution of prompt token j + 1
            rows = target.extend(prompt[done:end])
            scored += token_logprobs(rows, prompt[done + 1:end + 1], top)
        if end >= len(prompt) - 1:
            target.clear()
            active.scoring = False
        return end - done

    def _prefill_chunk(self, active: _Active, budget: int) -> int:
        """Up to `budget` more prompt tokens of this request, in whole aligned chunks but the last.

        Example: a 300-token prompt, 0 cached, budget 128, alignment 64: tokens [0, 128) now, and
        [128, 256), [256, 299) in the next steps (the last chunk ends with the prompt)."""
        if active.scoring:
            return self._score_chunk(active, budget)
        prefix = active.request.prompt_token_ids[:-1]
        slot = self.engine.slots[active.slot]
        done = len(slot.target.tokens)
        end = min(len(prefix), done + budget)
        if end < len(prefix) and slot.target.alignment > 1:
            end = max(done, end // slot.target.alignment * slot.target.alignment)  # whole chunks (sequence.py)
        if end > done:
            # Room for the whole generation before its cells are placed: a sequence's cells only
            # rise, and parked starts dropped later would free cells below it.
            self._make_room(slot.target.seq_id, self._expected_end(active.request))
            slot.target.prefill(prefix[:end])
        active.admitted.drafter.prefill(prefix[:end])  # a draft model keeps its cache in step itself
        return end - done

    def _prefill_rank(self, active: _Active) -> tuple[int, int]:
        """Overdue prompts first (the sort keeps their admission order), then the fewest tokens left."""
        return (0, 0) if active.passed_over >= PREFILL_PATIENCE else (1, self._prompt_left(active))

    def _prompt_left(self, active: _Active) -> int:
        """Prompt tokens this request has still to process (its last is the first decode row's)."""
        return max(0, len(active.request.prompt_token_ids) - 1 - len(self.engine.slots[active.slot].target.tokens))

    def _prompt_done(self, active: _Active) -> bool:
        return not active.scoring and self._prompt_left(active) == 0

    def _start(self, active: _Active) -> list[Item]:
        generation = active.admitted
        generation.start(started_at=active.added_at)
        active.started = True
        items: list[Item] = [Started(len(active.request.prompt_token_ids), generation.cached_prompt_tokens,
                                     active.prompt_logprobs)]
        if generation.finished:  # nothing to generate (max_tokens 0): cancel() returns its final event
            items.append(generation.cancel())
        return items

    def _decode(self, items: list, batched: bool) -> None:
        ready = [(handle, active) for handle, active in self._active.items()
                 if active.started and not active.admitted.finished and not self._failed(items, handle)]
        planned = self._plan_together(items, ready, batched)
        running, plans = [handle for handle, _ in planned], [tokens for _, tokens in planned]
        # Cells taken before the shared forward: a sequence with no room fails alone, not the forward.
        target = self.engine.target
        for handle, tokens in zip(running, plans):
            sequence = self._active[handle].admitted.target
            self._make_room(sequence.seq_id, len(sequence.tokens) + len(tokens))
            self._guarded(items, handle, target.reserve, sequence.seq_id, len(sequence.tokens) + len(tokens))
        placed = [(handle, tokens) for handle, tokens in zip(running, plans) if not self._failed(items, handle)]
        running, plans = [handle for handle, _ in placed], [tokens for _, tokens in placed]
        if not running:
            return
        generations = [self._active[handle].admitted for handle in running]
        try:
            for handle, event in zip(running, self._verify(generations, plans, batched)):
                items.append((handle, event))
        except Exception as exc:  # a failed shared forward: what was in it fails, the rest goes on
            logger.exception("a verification forward failed")
            done = {handle for handle, _ in items}
            for handle in running:
                if handle not in done:
                    items.append((handle, Failed(exc)))
                    self._reset_slot(self._active[handle].slot)

    def _plan_together(self, items: list, ready: list[tuple[int, _Active]], batched: bool) -> list[tuple[int, list[int]]]:
        """Every ready generation's plan (pending token + drafts). The draft-model forwards their
        proposals need run together: one forward per draft position for all the streams drafting,
        not one per stream. Each prices its rows on top of those the streams before it planned, and
        its draft forwards as shared with the streams that drafted with the model last round."""
        streams = len(ready) if batched else 1  # sequential forwards: each stream is priced alone
        drafted_last = self._drafting & {handle for handle, _ in ready}
        waiting: dict[int, tuple[Generator[DraftForward, DraftReply, list[int]], DraftForward]] = {}
        plans: dict[int, list[int]] = {}

        def advance(handle: int, steps: Generator[DraftForward, DraftReply, list[int]], reply: Optional[DraftReply]) -> None:
            try:
                forward = next(steps) if reply is None else steps.send(reply)
            except StopIteration as done:
                plans[handle] = done.value
            else:
                waiting[handle] = (steps, forward)

        for handle, active in ready:
            sharers = 1 + len(drafted_last - {handle}) if batched else 1
            # A stream still drafting with the model counts one row: its length is decided as it drafts.
            rows_before = sum(len(tokens) - 1 for tokens in plans.values()) + len(waiting) if batched else 0
            self._guarded(items, handle, advance, handle, active.admitted.plan_steps(streams, sharers, rows_before), None)
        self._drafting = set(waiting)
        while waiting:
            for handle, (_, forward) in waiting.items():  # as before the target's forward: a sequence without room fails alone
                sequence = forward.sequence
                self._guarded(items, handle, sequence.backend.reserve, sequence.seq_id, len(sequence) + len(forward.tokens))
            batch = [(handle, entry) for handle, entry in waiting.items() if not self._failed(items, handle)]
            waiting.clear()
            if not batch:
                break
            try:
                replies = self._draft_forwards([forward for _, (_, forward) in batch])
            except Exception as exc:  # a failed shared draft forward: the proposals in it fail
                logger.exception("a draft forward failed")
                for handle, _ in batch:
                    items.append((handle, Failed(exc)))
                    self._reset_slot(self._active[handle].slot)
                continue
            for (handle, (steps, _)), reply in zip(batch, replies):
                self._guarded(items, handle, advance, handle, steps, reply)
        return [(handle, plans[handle]) for handle, _ in ready if handle in plans]

    def _draft_forwards(self, forwards: list[DraftForward]) -> list[DraftReply]:
        """The forwards in one call per draft backend, timed; each is answered with its last
        logits row and an equal share of the call's seconds."""
        replies: dict[int, DraftReply] = {}
        backends: dict[int, list[int]] = {}
        for index, forward in enumerate(forwards):
            backends.setdefault(id(forward.sequence.backend), []).append(index)
        for indices in backends.values():
            group = [forwards[i] for i in indices]
            started = self.clock()
            rows = group[0].sequence.backend.eval_many(
                [(f.sequence.seq_id, len(f.sequence.tokens), list(f.tokens)) for f in group])
            share = (self.clock() - started) / len(group)
            for index, forward, logits in zip(indices, group, rows):
                forward.sequence.record(forward.tokens)
                replies[index] = DraftReply(logits[-1], share)
        return [replies[index] for index in range(len(forwards))]

    def _verify(self, generations: list[Generation], plans: list[list[int]], batched: bool) -> Iterator[StreamEvent]:
        """Each generation's plan evaluated on the target, timed, and committed (in order)."""
        requests = [(g.target.seq_id, len(g.target.tokens), tokens) for g, tokens in zip(generations, plans)]
        target, clock = self.engine.target, self.clock
        if batched:
            t0 = clock()
            rows = target.eval_many(requests)
            seconds = [clock() - t0] * len(requests)
            if len(requests) > 1 and self.engine.cost_model is not None:  # what `auto` prices shared rounds by
                self.engine.cost_model.observe_shared(sum(len(tokens) for _, _, tokens in requests), seconds[0])
        else:
            rows, seconds = [], []
            for request in requests:
                t0 = clock()
                rows.append(target.eval(*request))
                seconds.append(clock() - t0)
        alone = len(requests) == 1 or not batched  # a shared forward times no one sequence
        for generation, logits, spent in zip(generations, rows, seconds):
            yield generation.commit(logits, spent, alone)

    # -- helpers -----------------------------------------------------------------------------
    def _guarded(self, items: list, handle: int, stage: Callable, *args):
        """Run one request's stage and return its result; if it fails, only that request fails."""
        try:
            return stage(*args)
        except Exception as exc:
            if not isinstance(exc, SpecdecError):
                logger.exception("generation failed in %s", getattr(stage, "__name__", "a stage"))
            items.append((handle, Failed(exc)))
            self._reset_slot(self._active[handle].slot)
            return None

    @staticmethod
    def _failed(items: list, handle: int) -> bool:
        return any(h == handle and isinstance(item, Failed) for h, item in items)

    def _release(self, handle: int) -> None:
        active = self._active.pop(handle, None)
        if active is not None:
            self._last_used[active.slot] = self.clock()

    def _reset_slot(self, index: int) -> None:
        """Forget a slot's caches after a failure left them in an unknown state."""
        slot = self.engine.slots[index]
        for sequence in (slot.target, slot.draft):
            if sequence is not None:
                try:
                    sequence.clear()
                except Exception:
                    logger.exception("could not reset slot %d", index)
                    sequence.tokens.clear()

