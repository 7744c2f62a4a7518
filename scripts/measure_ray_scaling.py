"""The real pair on Ray Serve against the single-process server, on one machine. Not run in CI.

    .venv/bin/python scripts/measure_ray_scaling.py scaling [--streams 4,8] [--rounds 2]
    .venv/bin/python scripts/measure_ray_scaling.py prefix [--rounds 2]

`scaling`: `specdec serve --threads 2` (one process), `specdec serve --ray --replicas 1
--threads-per-replica 2` and `--replicas 2 --threads-per-replica 1`, each with as many slots in
all as there are streams; per run 2 x streams Spec-Bench mt_bench first turns (greedy,
128 tokens, the server's default method), each under its own API key, `streams` of them in
flight at once. Setups alternate in order between rounds. Prints one JSON line per run (aggregate
tokens/s, p50/p95 end-to-end latency, p50 time to first token, texts) and a summary: medians
over rounds, and how many texts equal the single-process server's.

`prefix`: what prefix-affinity routing buys. Two replicas of one thread and 4 slots each; four
Spec-Bench summarization articles (their first 2,000 characters), each asked three questions,
every request under its own API key, two in flight, 32 tokens each; `--prefix-routing-chars 1024` (default) against `0` (API key only),
alternating. Reports wall time, mean time to first token and prompt tokens served from the
prefix cache (`usage.prompt_tokens_details.cached_tokens`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdec.bench.datasets import load_prompts  # noqa: E402
from specdec.machine_profile import cpu_model_name  # noqa: E402
from specdec.server.testing import free_port  # noqa: E402



def start(command: list[str], port: int) -> subprocess.Popen:
    """The server command, once /health answers 200 and a completion succeeds."""
    process = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port),
                                "--log-level", "warning", *command], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
                if httpx.post(url + "/v1/completions", timeout=120, json={
                        "model": model, "prompt": "Hi", "max_tokens": 2}).status_code == 200:
                    return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise SystemExit(f"{command} did not start: {process.stderr.read()[-3000:]}")
        time.sleep(1)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever Ray left in the group
    except ProcessLookupError:
        pass
    process.wait()


async def one_request(client: httpx.AsyncClient, url: str, model: str, key: str, messages: list[dict],
                      max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, [], None
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        replica = response.headers.get("x-specdec-replica", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter() - started
                text.append(chunk["choices"][0]["delta"]["content"])
            usage = chunk.get("usage") or usage
    return {"key": key, "replica": replica, "seconds": time.perf_counter() - started, "ttft": first, "text": "".join(text),
            "tokens": usage["completion_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def run_load(port: int, requests: list[tuple[str, list[dict]]], in_flight: int, max_tokens: int) -> dict:
    """`requests` (key, messages) in order, `in_flight` at a time."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    results = []

    async def worker(client, model):
        while not queue.empty():
            key, messages = queue.get_nowait()
            results.append(await one_request(client, f"http://127.0.0.1:{port}/v1/chat/completions", model, key,
                                             messages, max_tokens))

    async with httpx.AsyncClient(timeout=900) as client:
        model = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"][0]["id"]
        started = time.perf_counter()
        await asyncio.gather(*(worker(client, model) for _ in range(in_flight)))
        wall = time.perf_counter() - started
    results.sort(key=lambda r: r["key"])
    latencies = sorted(r["seconds"] for r in results)
    return {"wall_seconds": round(wall, 2), "tokens": sum(r["tokens"] for r in results),
            "tokens_per_second": round(sum(r["tokens"] for r in results) / wall, 2),
            "p50_seconds": round(statistics.median(latencies), 2),
            "p95_seconds": round(latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))], 2),
            "ttft_p50_seconds": round(statistics.median(r["ttft"] for r in results), 2),
            "ttft_mean_seconds": round(statistics.mean(r["ttft"] for r in results), 2),
            "cached_prompt_tokens": sum(r["cached"] for r in results),
            "texts": {r["key"]: r["text"] for r in results}, "replicas": {r["key"]: r["replica"] for r in results}}


def scaling(args) -> None:
    prompts = load_prompts("spec-bench", ["mt_bench"])
    setups = {
        "serve 1x2": lambda slots: ["--threads", "2", "--parallel", str(slots)],
        "ray 1x2": lambda slots: ["--ray", "--replicas", "1", "--threads-per-replica", "2", "--parallel", str(slots)],
        "ray 2x1": lambda slots: ["--ray", "--replicas", "2", "--threads-per-replica", "1",
                                  "--parallel", str(slots // 2)],
    }
    runs = []
    for round_no in range(args.rounds):
        for level_no, streams in enumerate(args.streams):
            requests = [(f"user-{i:02d}", [{"role": "user", "content": prompts[i].text}]) for i in range(2 * streams)]
            order = list(setups) if (round_no + level_no) % 2 == 0 else list(reversed(setups))
            for name in order:
                port = free_port()
                process = start(setups[name](streams), port)
                try:
                    result = asyncio.run(run_load(port, requests, streams, 128))
                finally:
                    stop(process)
                result.update(setup=name, streams=streams, round=round_no)
                runs.append(result)
                print(json.dumps({k: v for k, v in result.items() if k not in ("texts", "replicas")}), flush=True)
    print("## summary (medians over rounds; texts equal to `serve 1x2`'s in the same round)")
    for streams in args.streams:
        for name in setups:
            mine = [r for r in runs if r["setup"] == name and r["streams"] == streams]
            same = sum(sum(a == b for a, b in zip(r["texts"].values(), base["texts"].values()))
                       for r in mine for base in runs
                       if base["setup"] == "serve 1x2" and base["streams"] == streams and base["round"] == r["round"])
            print(json.dumps({"setup": name, "streams": streams, **{
                k: statistics.median(r[k] for r in mine) for k in
                ("tokens_per_second", "p50_seconds", "p95_seconds", "ttft_p50_seconds")},
                "tokens_per_second_runs": [r["tokens_per_second"] for r in mine],
                "identical_texts": f"{same}/{sum(len(r['texts']) for r in mine)}"}), flush=True)


def prefix(args) -> None:
    articles = [p.text[:2000] for p in load_prompts("spec-bench", ["summarization"])[:4]]
    questions = ["Summarize the text above in one sentence.", "Who is the text above about?",
                 "List three facts from the text above."]
    requests = [(f"reader-{q}-{d}", [{"role": "user", "content": f"{article}\n\n{question}"}])
                for q, question in enumerate(questions) for d, article in enumerate(articles)]
    common = ["--ray", "--replicas", "2", "--threads-per-replica", "1", "--parallel", "4"]
    runs = []
    for round_no in range(args.rounds):
        for chars in ((1024, 0) if round_no % 2 == 0 else (0, 1024)):
            port = free_port()
            process = start([*common, "--prefix-routing-chars", str(chars)], port)
            try:
                result = asyncio.run(run_load(port, requests, 2, 32))
            finally:
                stop(process)
            # How many replicas each article's three requests went to (1: all on one).
            spread = [len({result["replicas"][f"reader-{q}-{d}"] for q in range(len(questions))})
                      for d in range(len(articles))]
            result.update(prefix_routing_chars=chars, round=round_no, replicas_per_article=spread)
            runs.append(result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("texts", "replicas")}), flush=True)
    print("## summary (medians over rounds)")
    for chars in (1024, 0):
        mine = [r for r in runs if r["prefix_routing_chars"] == chars]
        print(json.dumps({"prefix_routing_chars": chars, **{k: statistics.median(r[k] for r in mine) for k in
                          ("wall_seconds", "ttft_mean_seconds", "cached_prompt_tokens", "tokens_per_second")},
                          "wall_seconds_runs": [r["wall_seconds"] for r in mine]}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["scaling", "prefix"])
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    print(json.dumps({"cpu": cpu_model_name(), "avx512": avx512, "cpus": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d %H:%M")}), flush=True)
    scaling(args) if args.what == "scaling" else prefix(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
