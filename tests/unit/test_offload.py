"""Request work off the event loop, a few jobs at a time and fairly between tenants
(server/offload.py), and queue places reserved before a prompt is encoded (scheduler.reserve)."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app, offload
from specdec.server.offload import FairLimiter
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(120)
MODEL = "fake-target"


async def _holders_in_order(limiter: FairLimiter, jobs: list[str]) -> list[str]:
    """Each job (named by its tenant) takes a place in the order given; the order they got one."""
    order: list[str] = []
    release = asyncio.Event()

    async def job(tenant: str, first: bool) -> None:
        async with limiter.place(tenant):
            order.append(tenant)
            if first:
                await release.wait()  # holds the one place while the others line up

    first = asyncio.create_task(job(jobs[0], True))
    await asyncio.sleep(0)
    others = []
    for tenant in jobs[1:]:
        others.append(asyncio.create_task(job(tenant, False)))
        await asyncio.sleep(0)  # lined up in this order
    assert limiter.busy == 1 and limiter.waiting == len(jobs) - 1
    release.set()
    await asyncio.gather(first, *others)
    return order


def test_a_freed_place_goes_to_the_tenants_in_turn():
    order = asyncio.run(_holders_in_order(FairLimiter(1), ["a", "a", "a", "a", "a", "b", "c"]))
    # a's four waiting jobs came first, yet b and c each waited for one of them only
    assert order == ["a", "a", "b", "c", "a", "a", "a"]


def test_places_bound_the_jobs_at_once_and_cancelled_waiters_take_none():
    async def run() -> tuple[int, int, int]:
        limiter = FairLimiter(2)
        running = peak = 0

        async def job() -> None:
            nonlocal running, peak
            async with limiter.place("t"):
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.01)
                running -= 1

        waiting = [asyncio.create_task(job()) for _ in range(10)]
        await asyncio.sleep(0.001)
        waiting[5].cancel()  # one that waits for a place
        results = await asyncio.gather(*waiting, return_exceptions=True)
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        return peak, cancelled, limiter.busy + limiter.waiting

    peak, cancelled, left = asyncio.run(run())
    assert peak == 2 and cancelled == 1 and left == 0


def test_a_job_cancelled_as_its_place_comes_passes_the_place_on():
    async def run() -> list[str]:
        limiter = FairLimiter(1)
        order: list[str] = []
        hold = asyncio.Event()

        async def job(name: str) -> None:
            async with limiter.place(name):
                order.append(name)
                if name == "first":
                    await hold.wait()

        first = asyncio.create_task(job("first"))
        await asyncio.sleep(0)
        doomed, last = asyncio.create_task(job("doomed")), asyncio.create_task(job("last"))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.sleep(0)  # first leaves: the place is granted to doomed, which has not run yet
        doomed.cancel()
        await asyncio.gather(first, last)
        assert doomed.cancelled() and limiter.busy == 0 and limiter.waiting == 0
        return order

    assert asyncio.run(run()) == ["first", "last"]


def test_a_crowd_is_encoded_a_few_at_a_time_and_what_the_queue_refuses_is_never_encoded(monkeypatch):
    """50 requests at once on 2 slots and a queue of 2: those refused get their 429 before their
    prompt is encoded, and no more prompts are encoded at once than the offload places (with
    anyio's 40 threads every one of the 50 was encoded, most of them at once, for nothing)."""
    lock = threading.Lock()
    encoding = {"now": 0, "peak": 0, "calls": 0}
    encode = Engine.encode_prompt

    def slow_encode(self, *args, **kwargs):
        with lock:
            encoding["now"] += 1
            encoding["calls"] += 1
            encoding["peak"] = max(encoding["peak"], encoding["now"])
        time.sleep(0.02)  # a long template, held like the GIL-bound work it stands for
        try:
            return encode(self, *args, **kwargs)
        finally:
            with lock:
                encoding["now"] -= 1

    monkeypatch.setattr(Engine, "encode_prompt", slow_encode)
    engine = Engine(FakeBackend(seed=7), n_slots=2)
    app = create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("off", 4), max_queue=2))

    async def crowd(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"say {i}"}]}) for i in range(50)))
        return [answer.status_code for answer in answers]

    with serve_in_thread(app) as (url, _):
        statuses = asyncio.run(crowd(url))
    assert set(statuses) <= {200, 429} and 429 in statuses, statuses
    assert encoding["calls"] == statuses.count(200), (encoding, statuses.count(200))
    assert encoding["peak"] <= offload.default_places(), encoding
