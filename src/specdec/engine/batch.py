"""Continuous batching's engine work: what one scheduler iteration asks of the engine for the
generations that share it (one per slot).

    begin          a generation in a slot, reusing the slot's cached prefix of its prompt
    prefill_chunk  up to a budget of prompt tokens, in whole aligned chunks (exact reuse later)
    verify_batch   every running generation's plan verified in ONE target forward, then committed

The server's scheduler (server/scheduler.py) keeps queues, tickets, deadlines and error mapping,
and calls these with each request's failure isolated; anything that hosts the engine without
HTTP can call them the same way.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from specdec.engine.decoder import Generation
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, StreamEvent


def begin(engine: Engine, request: GenerationRequest, slot: int) -> tuple[Generation, float, int]:
    """(generation, admitted_at on the engine's clock, prompt tokens reused from the slot's cache)."""
    generation = engine.new_generation(request, slot=slot)
    admitted_at = engine.clock()
    cached = 0
    if engine.config.prefix_cache:
        cached = engine.slots[slot].target.reuse_prefix(request.prompt_token_ids[:-1])
    return generation, admitted_at, cached


def prompt_done(engine: Engine, slot: int, request: GenerationRequest) -> bool:
    """Whether the slot's target cache holds the whole prompt but its last token (the pending one)."""
    return len(engine.slots[slot].target.tokens) >= len(request.prompt_token_ids) - 1


def prefill_chunk(engine: Engine, slot: int, request: GenerationRequest, budget: int) -> int:
    """Process up to `budget` more prompt tokens of this slot; returns how many.

    Example: a 300-token prompt, 0 cached, budget 128, alignment 64: tokens [0, 128) now, and
    [128, 256), [256, 299) in the next calls (the last chunk ends with the prompt)."""
    prefix = request.prompt_token_ids[:-1]
    chosen = engine.slots[slot]
    done = len(chosen.target.tokens)
    end = min(len(prefix), done + budget)
    alignment = chosen.target.alignment
    if end < len(prefix) and alignment > 1:
        end = max(done, end // alignment * alignment)  # chunks are processed whole (sequence.py)
    if end > done:
        chosen.target.prefill(prefix[:end])
    if request.spec.method == "draft" and chosen.draft is not None:
        chosen.draft.prefill(prefix[:end])
    return end - done


def verify_batch(engine: Engine, generations: Sequence[Generation], plans: Sequence[list[int]],
                 batched: bool = True) -> Iterator[StreamEvent]:
    """Evaluate each generation's plan (its pending token and drafts) on the target and commit it;
    yields each generation's event in order, as it is committed.

    `batched`: one `eval_many` forward for all (the fixed cost of a forward paid once); else one
    forward per generation (exact by construction, for backends whose batched logits are not)."""
    requests = [(generation.target.seq_id, len(generation.target.tokens), tokens)
                for generation, tokens in zip(generations, plans)]
    target, clock = engine.target, engine.clock
    if batched:
        t0 = clock()
        rows = target.eval_many(requests)
        seconds = [clock() - t0] * len(requests)
    else:
        rows, seconds = [], []
        for request in requests:
            t0 = clock()
            rows.append(target.eval(*request))
            seconds.append(clock() - t0)
    alone = len(requests) == 1 or not batched  # a batched forward times no one sequence
    for generation, tokens, logits, spent in zip(generations, plans, rows, seconds):
        generation.target.record(tokens)
        generation.stats.verify_seconds += spent
        yield generation.commit(logits, spent if alone else None)
