"""`specdec serve --ray` itself, as a user runs it: the command starts its own local Ray (not the
cluster RAY_ADDRESS names), serves through Ray's proxy (fake engines), and on SIGTERM deletes the
deployment, stops Ray and exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

from specdec.server.testing import free_port  # noqa: E402
from test_ray_serve import wait_for_answer  # noqa: E402

pytestmark = pytest.mark.timeout(180)

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"


def test_serve_ray_command_serves_then_stops_on_sigterm():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           # Without --address the command starts its own Ray: it must not try to join this one.
           "RAY_ADDRESS": "127.0.0.1:1"}
    command = [sys.executable, "-m", "specdec.cli", "serve", "--ray", "--port", str(port), "--replicas", "2",
               "--model", "fake.gguf", "--served-model-name", "m", "--method", "ngram", "--drain-grace", "5",
               "--engine-factory", "fakes.fake_serve:fake_engine", "--log-level", "warning"]
    body = {"model": "m", "prompt": "the cat sat", "max_tokens": 8, "temperature": 0}
    with tempfile.TemporaryFile() as log:
        # Its own session: whatever Ray leaves behind can be ended with the group.
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        try:
            response = wait_for_answer(lambda: httpx.post(url + "/v1/completions", json=body, timeout=10), process,
                                       log, "specdec serve --ray")
            assert response.json()["choices"][0]["finish_reason"] == "length"
            # The proxy's router learns of the second replica a moment after the first answers:
            # rounds of 16 keys until both answered, within a deadline.
            replicas: set[str] = set()
            deadline = time.monotonic() + 60
            while len(replicas) < 2 and time.monotonic() < deadline:
                replicas |= {httpx.post(url + "/v1/completions", json=body, timeout=10,
                                        headers={"Authorization": f"Bearer k{i}"}).headers["x-specdec-replica"]
                             for i in range(16)}
            assert len(replicas) == 2
            process.send_signal(signal.SIGTERM)
            assert process.wait(90) == 0
            with pytest.raises(httpx.TransportError):
                httpx.get(url + "/health", timeout=5)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            try:
                os.killpg(process.pid, signal.SIGKILL)  # Ray's agents, should they outlive their raylet
            except ProcessLookupError:
                pass
