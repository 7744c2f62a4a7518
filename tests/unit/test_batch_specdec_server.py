"""`specdec batch` against specdec's own server on fake backends: --compare gives the same greedy
texts with speculation off and on, the usage carries the speculative block, and an overloaded server
(queue full → 429 with Retry-After) still ends with every request done exactly once."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from specdec.backends.fake import FakeBackend
from specdec.cli import main
from specdec.client import AsyncClient, RetryPolicy
from specdec.client.batch import BatchSettings, read_input, read_results, run_batch
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(60)
MODEL = "fake-target"
PROMPTS = ["the cat sat on the mat", "abc abc abc", "hello wörld", "x", "the the the cat", "on the mat on the"]


def serve(n_slots=4, **config):
    engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=n_slots)
    app = create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4), **config))
    return serve_in_thread(app)


def write_input(path):
    entries = [{"id": f"chat-{i}", "messages": [{"role": "user", "content": p}]} for i, p in enumerate(PROMPTS)]
    entries += [{"id": f"text-{i}", "prompt": p, "max_tokens": 12} for i, p in enumerate(PROMPTS[:3])]
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path, len(entries)


def test_compare_against_specdec_server(tmp_path, capsys):
    inp, n = write_input(tmp_path / "in.jsonl")
    with serve() as (url, _):
        rc = main(["batch", str(inp), "--out", str(tmp_path / "res.jsonl"), "--base-url", url + "/v1",
                   "--concurrency", "3", "--max-tokens", "24", "--temperature", "0", "--compare",
                   "--report", str(tmp_path / "report.md"), "--machine-hour-price", "1.0"])
    assert rc == 0, capsys.readouterr().err
    off, _ = read_results(tmp_path / "res.off.jsonl")
    on, _ = read_results(tmp_path / "res.on.jsonl")
    assert len(off) == len(on) == n and all(r["error"] is None for r in off + on)
    assert all(r["model"] == MODEL for r in off + on)  # discovered from /v1/models
    assert {r["usage"]["speculative"]["method"] for r in off} == {"off"}
    assert {r["usage"]["speculative"]["method"] for r in on} == {"draft"}
    assert sum(r["usage"]["speculative"]["drafted_tokens"] for r in on) > 0
    assert {r["id"]: r["text"] for r in off} == {r["id"]: r["text"] for r in on}  # lossless
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["comparison"]["identical_texts"] == n
    assert doc["runs"][1]["speculative"]["acceptance_rate"] is not None
    assert all(run["ttft_seconds"]["count"] == n for run in doc["runs"])


def test_overloaded_server_every_request_once(tmp_path):
    inp, n = write_input(tmp_path / "in.jsonl")
    items = read_input(inp)

    async def short_sleep(seconds):  # the server asks for 1 s; a tenth keeps the test short
        await asyncio.sleep(min(seconds, 1.0) / 10)

    async def run(url):
        async with AsyncClient(url + "/v1", sleep=short_sleep, retry=RetryPolicy(max_attempts=60)) as client:
            settings = BatchSettings(model=MODEL, max_tokens=16, temperature=0.0, concurrency=len(items))
            return await run_batch(client, items, tmp_path / "out.jsonl", settings)

    with serve(n_slots=1, max_queue=1) as (url, _):
        outcome = asyncio.run(run(url))
    records, unreadable = read_results(tmp_path / "out.jsonl")
    assert unreadable == 0 and outcome.ok == n and outcome.failed == 0
    assert Counter(r["id"] for r in records) == Counter(i.id for i in items)
    rejected = [a for r in records for a in r["attempts"] if a["status_code"] == 429]
    assert rejected, "the queue should have overflowed"
    assert all(a["retry_after"] == 1.0 for a in rejected)
