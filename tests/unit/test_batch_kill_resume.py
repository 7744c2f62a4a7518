"""Kill-and-resume: `python -m specdec.cli batch` is SIGKILLed twice mid-run (once with a torn last
line added, as a kill inside a write leaves), then rerun; every id ends with exactly one success."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from fakes.openai_server import FakeServer, FakeServerConfig

pytestmark = pytest.mark.timeout(60)
SRC = Path(__file__).resolve().parents[2] / "src"
N_ITEMS = 30


def launch(inp: Path, out: Path, base_url: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "specdec.cli", "batch", str(inp), "--out", str(out),
                             "--base-url", base_url, "--model", "fake-model", "--concurrency", "3",
                             "--speculative", "off", "--no-progress", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_after(proc: subprocess.Popen, out: Path, n_lines: int, deadline: float = 20.0) -> None:
    """SIGKILL the batch once the results file holds `n_lines` complete lines."""
    stop = time.monotonic() + deadline
    while time.monotonic() < stop:
        if out.exists() and out.read_bytes().count(b"\n") >= n_lines:
            proc.kill()  # SIGKILL: no cleanup, requests in flight are abandoned
            proc.wait()
            return
        if proc.poll() is not None:
            pytest.fail(f"batch ended before it could be killed: {proc.communicate()}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail("batch made no progress")


def test_killed_batch_resumes_with_each_id_done_once(tmp_path):
    config = FakeServerConfig(token_delay=0.02, answer_tokens=8)  # ~0.16 s a request with speculation off
    inp = tmp_path / "in.jsonl"
    entries = [{"id": i, "messages": [{"role": "user", "content": f"item {i}" + (" [[faults: 429]]" if i % 4 == 0 else "")}]}
               for i in range(N_ITEMS)]
    inp.write_text("".join(json.dumps(e) + "\n" for e in entries))
    out = tmp_path / "results.jsonl"
    with FakeServer(config) as server:
        kill_after(launch(inp, out, server.base_url), out, 4)
        first_kill = out.read_bytes()
        # As if the kill had landed inside a write: a torn, unterminated success line for an id.
        with open(out, "ab") as f:
            f.write(json.dumps({"id": N_ITEMS - 1, "text": "t0 t1", "error": None})[:30].encode())
        kill_after(launch(inp, out, server.base_url), out, 14)
        assert out.read_bytes().startswith(first_kill)
        final = launch(inp, out, server.base_url, "--report", str(tmp_path / "report.md"))
        stdout, stderr = final.communicate(timeout=40)
        assert final.returncode == 0, stderr
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b""  # the file ends on a complete line
    records = [json.loads(line) for line in lines[:-1]]  # every line parses: the torn one was cut
    successes = Counter(r["id"] for r in records if r["error"] is None)
    assert successes == Counter(range(N_ITEMS))  # each id exactly once as a success
    assert all(r["text"] == "t0 t1 t2 t3 t4 t5 t6 t7 " for r in records if r["error"] is None)
    doc = json.loads((tmp_path / "report.json").read_text())
    requests = doc["runs"][0]["requests"]
    assert (requests["ok"], requests["failed"], requests["not_run"], requests["duplicate_successes"]) == (N_ITEMS, 0, 0, 0)
    assert "already done" in stderr
