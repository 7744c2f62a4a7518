"""One tenant's prompts are never reused for, nor counted in the usage of, another tenant's
requests (engine/core.py), and a tenant holding slots waits behind one holding fewer
(server/scheduler.py)."""
import asyncio
from collections import deque

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig
from specdec.server.scheduler import Scheduler
from specdec.server.tickets import Ticket
from specdec.types import GenerationRequest, SpecConfig

SYSTEM = tuple(range(40, 140))  # a long shared start, as a common system prompt


def request(tail, tenant):
    return GenerationRequest(SYSTEM + tail, 4, spec=SpecConfig("off", 0), tenant=tenant)


def cached_tokens(engine, req):
    return engine.generate(req).stats["cached_prompt_tokens"]


def test_a_prefix_is_reused_for_its_own_tenant_only():
    engine = Engine(FakeBackend(seed=3), n_slots=1)
    assert cached_tokens(engine, request((1, 2, 3), "alice")) == 0
    assert cached_tokens(engine, request((4, 5, 6), "alice")) >= len(SYSTEM) - 1  # her own prompt's start
    assert cached_tokens(engine, request((7, 8, 9), "bob")) == 0  # nothing of alice's is reused, or counted
    assert cached_tokens(engine, request((1, 2, 3), "alice")) == 0  # bob's text replaced hers: none of his either
    assert cached_tokens(engine, request((2, 3, 4), None)) == 0  # the anonymous are a tenant of their own


def test_reuse_for_another_tenant_would_not_change_the_text():
    """Isolation costs only time: the text is the one the request gets from scratch."""
    engine = Engine(FakeBackend(seed=3), n_slots=1)
    engine.generate(request((1, 2, 3), "alice"))
    shared = engine.generate(request((1, 2, 4), "bob"))
    fresh = Engine(FakeBackend(seed=3), n_slots=1).generate(request((1, 2, 4), "bob"))
    assert shared.token_ids == fresh.token_ids


def test_a_tenant_holding_slots_waits_behind_one_holding_none():
    engine = Engine(FakeBackend(seed=3), n_slots=2)
    scheduler = Scheduler(engine, ServerConfig())
    loop = asyncio.new_event_loop()
    try:
        tickets = [Ticket(request((i,), tenant), loop, 0.0, 1e9, lambda: None)
                   for i, tenant in enumerate(["alice", "alice", "alice", "bob"])]
        scheduler._waiting = deque(tickets[:1])
        scheduler._admit()  # alice's first takes a slot
        scheduler._waiting = deque(tickets[1:])
        scheduler._admit()  # one slot left: bob, holding none, goes before alice's second
        admitted = [run.ticket for run in scheduler._running.values()]
        assert admitted == [tickets[0], tickets[3]]
        assert list(scheduler._waiting) == tickets[1:3]  # alice's others keep their order
    finally:
        loop.close()
