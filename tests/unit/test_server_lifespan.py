"""The drain lives in the app's lifespan: any ASGI host that stops the app (a Ray Serve replica,
not only uvicorn) lets the requests in flight finish for the grace period, then ends the rest with
the shutting_down error event. Served here without uvicorn, through httpx's ASGI transport."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(60)


class SlowFake(FakeBackend):
    def eval_many(self, requests, *, prefill=False):
        time.sleep(0.01)  # a 100-token generation lasts about a second
        return super().eval_many(requests, prefill=prefill)


def lifespan_run(grace: float, max_tokens: int) -> tuple[httpx.Response, float]:
    """One request in flight when the app is asked to stop, served without uvicorn."""
    app = create_app(Engine(SlowFake(seed=7), n_slots=2),
                     ServerConfig(served_model_name="m", spec=SpecConfig("off", 0), drain_grace=grace))
    scheduler = app.state.specdec.scheduler

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
                request = asyncio.create_task(client.post("/v1/completions", json={
                    "model": "m", "prompt": "the cat", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}))
                while scheduler.num_running == 0:
                    assert not request.done(), request.result().text
                    await asyncio.sleep(0.01)
                stopping = asyncio.get_running_loop().time()
        # Leaving the lifespan ran the drain: the request has its answer by now.
        return await request, asyncio.get_running_loop().time() - stopping

    return asyncio.run(scenario())


def events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_lifespan_stop_lets_the_request_in_flight_finish():
    response, _ = lifespan_run(grace=30, max_tokens=60)
    lines = events(response)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(bool(c["choices"][0]["text"]) for c in chunks) > 1


def test_lifespan_stop_past_the_grace_period_ends_the_stream_with_an_error_event():
    response, seconds = lifespan_run(grace=0.3, max_tokens=1000)
    lines = events(response)
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "shutting_down"
    assert seconds < 10
