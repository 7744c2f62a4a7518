"""Ray Serve's autoscaling on specdec, observed: local Ray (one node of 2 CPUs), fake engine,
`--min-replicas 1 --max-replicas 2 --parallel 2` with short delays. Sustained streaming load above
the target adds a second replica and both replicas answer; load below it removes the replica
again; no stream fails or ends short meanwhile. Ray starts once for the module."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Callable, Optional

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from test_ray_serve import FLAGS, MODEL, local_deployment, replica_states  # noqa: E402

pytestmark = [pytest.mark.timeout(150),
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")]

UPSCALE_DELAY, DOWNSCALE_DELAY = 1.0, 2.0
AUTOSCALING_FLAGS = [*FLAGS, "--replicas", "1", "--parallel", "2", "--min-replicas", "1", "--max-replicas", "2",
                     "--upscale-delay", str(UPSCALE_DELAY), "--downscale-delay", str(DOWNSCALE_DELAY)]
# Test-only: Ray's controller otherwise hears of the load every 10 s and averages it over 30 s,
# which would make the test minutes long (docs/scale-out.md, Autoscaling).
FAST_METRICS = {"metrics_interval_s": 0.5, "look_back_period_s": 2.0}
MAX_TOKENS = 100  # 10 ms a fake forward: a stream lasts about a second
HEAVY_CLIENTS = 6  # 6 in flight: 3x the target of 2 per replica
START_FAILURES: list[str] = []


@pytest.fixture(scope="module")
def endpoint():
    with local_deployment(START_FAILURES, AUTOSCALING_FLAGS, running=1, autoscaling=FAST_METRICS) as url:
        yield url


def stream_once(http: httpx.Client, key: str) -> tuple[Optional[str], Optional[str]]:
    """One streamed chat completion: (the replica that answered, what was wrong with it or None)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            replica = r.headers.get("x-specdec-replica")
            if r.status_code != 200:
                return replica, f"status {r.status_code}: {r.read()[:200]!r}"
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        return None, repr(exc)
    if events[-1:] != ["[DONE]"]:
        return replica, f"no [DONE]: {events[-2:]}"
    chunks = [json.loads(event) for event in events[:-1]]
    if any("error" in chunk for chunk in chunks):
        return replica, f"error event: {[c for c in chunks if 'error' in c][0]}"
    if (chunks[-1].get("usage") or {}).get("completion_tokens") != MAX_TOKENS:
        return replica, f"ended short: {chunks[-1]}"
    return replica, None


class Load:
    """`clients` threads, each streaming one completion after another (its own API key) until stopped."""

    def __init__(self, endpoint: str, name: str, clients: int):
        self.endpoint = endpoint
        self.outcomes: list[tuple[Optional[str], Optional[str], float]] = []  # replica, problem, when it ended
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(f"{name}-{i}",), daemon=True)
                        for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def client(self, key: str) -> None:
        with httpx.Client(base_url=self.endpoint, timeout=60) as http:
            while not self.stopped.is_set():
                self.outcomes.append((*stream_once(http, key), time.monotonic()))

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(70)
            assert not thread.is_alive()

    def replicas_since(self, since: float) -> set[str]:
        return {replica for replica, _, ended in list(self.outcomes) if ended >= since}

    def problems(self) -> list[str]:
        return [problem for _, problem, _ in self.outcomes if problem]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition` held, polled every 0.2 s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s: replicas {replica_states()}"
        time.sleep(0.2)
    return time.monotonic() - start


def test_load_above_the_target_adds_a_replica_and_load_below_removes_it(endpoint):
    assert replica_states() == Counter({"RUNNING": 1})
    heavy = Load(endpoint, "heavy", HEAVY_CLIENTS)
    light = None
    try:
        scale_up = wait_until(lambda: replica_states() == Counter({"RUNNING": 2}), 60, "a second replica")
        both_serve = wait_until(lambda: len(heavy.replicas_since(time.monotonic() - 3)) == 2, 30,
                                "both replicas answering")
        # Below the target (one stream, target 2 a replica): the second replica goes, while requests run.
        light = Load(endpoint, "light", 1)
        heavy.stop()
        scale_down = wait_until(lambda: replica_states() == Counter({"RUNNING": 1}), 60, "back to one replica")
        after = time.monotonic()
        wait_until(lambda: light.replicas_since(after), 30, "a request after the scale-down")
        light.stop()
    finally:
        heavy.stop()
        if light is not None:
            light.stop()
    print(f"\nscale-up {scale_up:.1f} s after the load started (both replicas answering {both_serve:.1f} s later); "
          f"scale-down {scale_down:.1f} s after it stopped; {len(heavy.outcomes)} + {len(light.outcomes)} streams")
    assert heavy.problems() == [] and light.problems() == []
    assert len(light.replicas_since(0)) >= 1 and len(heavy.replicas_since(0)) == 2
