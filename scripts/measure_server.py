"""Aggregate throughput of `specdec serve` at 1, 2, 4 and 8 concurrent streams, time to first
token, and the server's resident memory, on the default pair. Not run in CI.

    .venv/bin/python scripts/measure_server.py [--methods off,ngram] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, method: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "speculative_decoding": {"method": method}}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft": ttft, "seconds": time.perf_counter() - t0, "tokens": usage["completion_tokens"]}


async def run_level(base: str, prompts: list[str], concurrency: int, method: str, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        url = f"{base}/v1/chat/completions"
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, model, prompts[i % len(prompts)], method, max_tokens)
                                         for i in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "method": method, "model": model, "tokens": tokens, "wall_seconds": wall,
            "aggregate_tokens_per_second": tokens / wall,
            "ttft_median_seconds": statistics.median(r["ttft"] for r in results if r["ttft"] is not None)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="off,ngram")
    parser.add_argument("--levels", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--spec-bench", default=os.environ.get("SPECDEC_SPEC_BENCH", "../shared/bench/spec_bench_questions.jsonl"))
    args = parser.parse_args()
    records = [json.loads(line) for line in Path(args.spec_bench).read_text().splitlines()]
    prompts = [r["turns"][0] for r in records if r["category"] in ("writing", "coding", "stem", "humanities")][:8]
    levels = [int(x) for x in args.levels.split(",")]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port),
                               "--parallel", str(max(levels)), "--method", "ngram"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"server exited: {server.stderr.read()[-2000:]}")
            time.sleep(1)
        print(json.dumps({"idle_memory_mib": rss_mib(server.pid)}))
        asyncio.run(run_level(base, prompts, 1, "off", 8))  # warm-up
        for method in args.methods.split(","):
            for level in levels:
                result = asyncio.run(run_level(base, prompts, level, method, args.max_tokens))
                result["memory_mib"] = rss_mib(server.pid)
                print(json.dumps(result), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
