"""Soak: does `specdec serve`'s memory level off over many requests? Not run in CI.

Starts the server (the fake models at full speed, or the real pair), sends N streaming chat
requests from many API keys (a few keys send most of them, as real tenants do; every answer is
checked: tests/fakes/load.py), and at ten checkpoints records the server's resident memory and what
it keeps between requests: the cross-request n-gram cache (tenants, n-grams), the tokens held in
the slots' prefix caches, and the size of /metrics.

    .venv/bin/python scripts/soak_server.py --fake --requests 2000 --out soak-fake.json
    .venv/bin/python scripts/soak_server.py --real --requests 200 --out soak-real.json

The cross-request cache's default bounds (32 tenants x 20,000 n-grams) hold; with 50 keys the
tenant bound is exercised, and long sampled answers fill the busiest tenants' tables.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fakes.fake_serve import rss_mib, serving  # noqa: E402
from fakes.load import fake_expected, run_load  # noqa: E402

GAUGES = ("specdec:ngram_cache_tenants", "specdec:ngram_cache_entries", "specdec:prefix_cache_tokens")


def server_state(url: str, pid: int) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    state = {name.split(":")[1]: 0.0 for name in GAUGES}
    for line in text.splitlines():
        for name in GAUGES:
            if line.startswith(name + "{"):
                state[name.split(":")[1]] = float(line.rsplit(" ", 1)[1])
    memory = rss_mib(pid)
    return {"rss_mib": round(memory["rss"], 1), "peak_rss_mib": round(memory["peak"], 1), **state,
            "metrics_bytes": len(text)}


def server_counts(url: str) -> dict:
    counts = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("specdec:http_requests_total{") and 'route="/v1/chat/completions"' in line:
            status = line.split('status="')[1].split('"')[0]
            counts[status] = counts.get(status, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


async def soak(url: str, pid: int, args) -> dict:
    checkpoints = [{"requests": 0, **server_state(url, pid)}]
    outcomes = []
    started = time.monotonic()
    step = max(1, args.requests // 10)
    while len(outcomes) < args.requests:
        batch = min(step, args.requests - len(outcomes))
        report = await run_load(url, args.model, fake_expected if args.fake else None, clients=args.clients,
                                total_requests=batch, seed=len(outcomes), api_keys=args.api_keys,
                                key_skew=args.key_skew, max_tokens=tuple(args.max_tokens), disconnect_rate=0.0)
        outcomes.extend(report.outcomes)
        checkpoints.append({"requests": len(outcomes), "seconds": round(time.monotonic() - started, 1),
                            **server_state(url, pid)})
        print(json.dumps(checkpoints[-1]), flush=True)
    answered = [o for o in outcomes if o.status == 200]
    served = server_counts(url)
    return {
        "requests": len(outcomes),
        "answered_200": len(answered),
        "rejected_429": sum(1 for o in outcomes if o.status == 429),
        "wrong_or_failed": sum(1 for o in outcomes if o.problem is not None),
        "server_counted": served,  # the server's own count of answers by status: nothing lost in between
        "problems": [o.problem for o in outcomes if o.problem is not None][:5],
        "completion_tokens": sum(o.completion_tokens for o in answered),
        "api_keys": args.api_keys,
        "key_skew": args.key_skew,
        "max_tokens": args.max_tokens,
        "checkpoints": checkpoints,
        "rss_start_mib": checkpoints[0]["rss_mib"],
        "rss_peak_mib": checkpoints[-1]["peak_rss_mib"],
        "rss_end_mib": checkpoints[-1]["rss_mib"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--fake", action="store_true", help="the fake models, at full speed (no forward costs)")
    which.add_argument("--real", action="store_true", help="the default pair (specdec serve)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--api-keys", type=int, default=50)
    parser.add_argument("--key-skew", type=float, default=1.0,
                        help="API key i sends with weight 1/(i+1)**SKEW (default 1: a few keys send most; 0: evenly)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--parallel", type=int, default=4, help="the server's slots")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=None,
                        help="drawn per request (default: 64 256 512 fake, 32 64 real)")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args()
    args.max_tokens = args.max_tokens or ([64, 256, 512] if args.fake else [32, 64])
    args.model = "fake" if args.fake else "soak"
    flags = ["--served-model-name", args.model, "--parallel", str(args.parallel), "--max-queue", "64",
             "--log-level", "warning"]
    if args.fake:
        context = serving(["--model", "fake.gguf", *flags])
    else:
        context = serving(flags, command=[sys.executable, "-m", "specdec.cli"], start_timeout=600)
    with context as (url, process):
        result = asyncio.run(soak(url, process.pid, args))
    result["server"] = "fake models, full speed" if args.fake else "the default pair"
    print(json.dumps({k: v for k, v in result.items() if k != "checkpoints"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["wrong_or_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
