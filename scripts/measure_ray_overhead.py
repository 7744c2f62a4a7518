"""What Ray Serve adds: start-up time and resident memory of `specdec serve --ray` against the
single-process `specdec serve`, both on the weightless fake engine (tests/fakes/fake_serve.py),
so that only the serving machinery is measured, not the models.

    python scripts/measure_ray_overhead.py [--replicas 2] [--requests 20]

For each: seconds from the command's start until /health answers 200 and a completion succeeds,
resident memory (VmRSS) summed over the command and every process under it (Ray's GCS, raylet,
agents, Serve controller, proxy, replicas), the same after N requests, and seconds from SIGTERM
to exit. Prints one JSON object per setup. Not part of CI; nothing here is simulated.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FAKE_SERVE = ROOT / "tests" / "fakes" / "fake_serve.py"


def children_of() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def tree_rss_mib(root: int) -> tuple[float, int]:
    """(resident MiB summed over `root` and its descendants, number of processes)."""
    tree, todo, total, count = children_of(), [root], 0, 0
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, ()))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    count += 1
        except OSError:
            pass
    return total / 1024, count


def measure(label: str, command: list[str], port: int, requests: int, env: dict) -> dict:
    url = f"http://127.0.0.1:{port}"
    body = {"model": "fake", "prompt": "the cat sat", "max_tokens": 16, "temperature": 0}
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        while True:
            try:
                if (httpx.get(url + "/health", timeout=5).status_code == 200
                        and httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200):
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() - started > 600:
                raise RuntimeError(f"{label} did not start")
            time.sleep(0.2)
        ready = time.monotonic() - started
        idle_rss, processes = tree_rss_mib(process.pid)
        for i in range(requests):
            httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer k{i % 4}"}, timeout=30)
        busy_rss, _ = tree_rss_mib(process.pid)
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(300)
        return {"setup": label, "ready_seconds": round(ready, 1), "processes": processes,
                "rss_mib_idle": round(idle_rss), "rss_mib_after_requests": round(busy_rss),
                "stop_seconds": round(time.monotonic() - stopping, 1), "exit_code": code}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--port", type=int, default=18123)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    common = ["serve", "--port", str(args.port), "--model", "fake.gguf", "--method", "ngram", "--parallel", "4"]
    runs = [
        ("specdec serve", [sys.executable, str(FAKE_SERVE), *common]),
        (f"specdec serve --ray --replicas {args.replicas}",
         [sys.executable, "-m", "specdec.cli", *common, "--ray", "--replicas", str(args.replicas),
          "--threads-per-replica", "1", "--engine-factory", "fakes.fake_serve:fake_engine"]),
    ]
    for label, command in runs:
        print(json.dumps(measure(label, command, args.port, args.requests, env)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
