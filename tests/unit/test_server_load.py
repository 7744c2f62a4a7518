"""Sustained load on a real `specdec serve` process (fake models with the timing shape of a real
forward, loopback): 64 concurrent streaming clients for 60 s against 4 slots and a queue of 16,
greedy and seeded sampling mixed over every method, 8 API keys, one request in 10 hung up on
mid-stream; then a crowd of 64 clients that all hang up at once.

Pass/fail is correctness only: every request either completes with exactly the text the engine
gives it alone or gets 429 with Retry-After; no 5xx, no transport error, no answer lost or
duplicated (the server's own counters agree with the clients'); after the crowd leaves, no slot
or queue place is held. Latency percentiles, throughput and the server's resident memory are
reported (printed, and written as JSON to $SPECDEC_LOAD_REPORT if set), never asserted.
SPECDEC_LOAD_SECONDS shortens the run for a local try.
"""
import asyncio
import json
import os
import random
import time

import httpx
import pytest
from fakes.fake_serve import rss_mib, serving
from fakes.load import LoadRequest, client_session, fake_expected, make_request, run_load, send

CLIENTS = 64
SECONDS = float(os.environ.get("SPECDEC_LOAD_SECONDS", "60"))
SLOTS, MAX_QUEUE = 4, 16
# Seconds per fake target forward: fixed + per decode row + per prompt row. The shape of the real
# pair's costs here (a verify of n rows costs about n one-row steps; prompt rows are far cheaper),
# about 4x faster, so that a minute sees a few hundred requests.
COSTS = {"forward": 0.004, "row": 0.012, "prompt_row": 0.001}
ROUTE = 'route="/v1/chat/completions"'

pytestmark = pytest.mark.timeout(int(SECONDS) + 180)


def counters(url) -> dict:
    """The server's own count of answered requests, by HTTP status and by how generations ended."""
    by_status, finished = {}, 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("specdec:http_requests_total{") and ROUTE in line:
            status = line.split('status="')[1].split('"')[0]
            by_status[status] = by_status.get(status, 0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("specdec:request_success_total{"):
            finished += float(line.rsplit(" ", 1)[1])
    return {"by_status": by_status, "finished": finished}


async def sample_rss(pid, samples, stop):
    while not stop.is_set():
        samples.append(rss_mib(pid)["rss"])
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def crowd_hangs_up(url, clients=CLIENTS):
    """Every client opens a long stream at once and hangs up: the admitted ones after their
    first chunk, the queued ones while still waiting for an answer."""
    rng = random.Random(1)
    admitted = refused = 0

    async def one():
        nonlocal admitted, refused
        request = make_request(rng, max_tokens=(400,))
        async with client_session(30) as http:
            try:
                hang_up = LoadRequest(request.prompt, 400, request.method, api_key=request.api_key, disconnect_after=2)
                outcome = await asyncio.wait_for(send(http, url, "fake", hang_up, fake_expected), 3.0)
            except asyncio.TimeoutError:
                return  # still queued: the client gives up waiting
            admitted += outcome.status == 200
            refused += outcome.status == 429

    await asyncio.gather(*(one() for _ in range(clients)))
    return admitted, refused


def test_64_streaming_clients_for_a_minute_lose_nothing(record_property):
    flags = ["--model", "fake.gguf", "--served-model-name", "fake", "--parallel", str(SLOTS),
             "--max-queue", str(MAX_QUEUE), "--method", "auto", "--log-level", "warning"]
    with serving(flags, COSTS) as (url, process):
        rss_start = rss_mib(process.pid)["rss"]

        async def main():
            samples, stop = [], asyncio.Event()
            sampler = asyncio.create_task(sample_rss(process.pid, samples, stop))
            report = await run_load(url, "fake", fake_expected, clients=CLIENTS, seconds=SECONDS, disconnect_rate=0.1)
            stop.set()
            await sampler
            return report, samples

        report, samples = asyncio.run(main())
        await_idle(url)
        served = counters(url)
        crowd_admitted, crowd_refused = asyncio.run(crowd_hangs_up(url))
        await_idle(url)  # nobody left holding a slot or a queue place
        after = asyncio.run(send_one(url, LoadRequest("the cat sat on the mat", 32, "auto")))
        memory = {"rss_start_mib": round(rss_start, 1), "rss_peak_mib": round(rss_mib(process.pid)["peak"], 1),
                  "rss_end_mib": round(rss_mib(process.pid)["rss"], 1),
                  "rss_max_sampled_mib": round(max(samples), 1)}

    summary = {"clients": CLIENTS, "slots": SLOTS, "max_queue": MAX_QUEUE, **report.summary(),
               "crowd_hung_up": {"admitted": crowd_admitted, "refused_429": crowd_refused}, **memory}
    print("\nload:", json.dumps(summary))
    record_property("load", json.dumps(summary))
    if os.environ.get("SPECDEC_LOAD_REPORT"):
        with open(os.environ["SPECDEC_LOAD_REPORT"], "w") as out:
            json.dump(summary, out, indent=1)

    assert summary["lost"] == 0 and summary["server_errors_5xx"] == 0
    assert summary["wrong"] == 0, report.problems()
    assert summary["completed"] > 0 and summary["rejected_429"] > 0  # the queue did fill up
    answered = report.count(lambda o: o.status == 200)  # whole streams and those hung up on purpose
    assert served["by_status"] == {"200": answered, "429": summary["rejected_429"]}
    assert served["finished"] == answered  # every accepted request ended exactly once on the server
    assert crowd_admitted > 0
    assert after.status == 200 and after.problem is None  # and the server still serves right


async def send_one(url, request):
    async with client_session(60) as http:
        return await send(http, url, "fake", request, fake_expected)


def await_idle(url, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        if health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
