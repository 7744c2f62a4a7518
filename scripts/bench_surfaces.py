"""The same prompts through each API surface of one `specdec serve`: chat completions, Responses and
Messages, streamed, greedy, on the default pair (one serving layer: no surface should pay a tax).
Per request the client times its text events: decode tok/s is (completion tokens - 1) over the
time from the first text event to the last. Surfaces rotate their order prompt by prompt and
repeat by repeat; each keyless request drafts from no other's history (the server's default). A
prompt's three requests share its text (so their greedy texts can be compared) and so its cached
prefix: their TTFTs are not comparable, their decode rates are. Not run in CI.

    .venv/bin/python scripts/bench_surfaces.py [--per-category 2] [--repeats 2] [--max-tokens 128]
        [-- extra `specdec serve` flags]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import httpx

from specdec.bench.datasets import SPEC_BENCH, load_prompts
from specdec.server.testing import free_port

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from measure_shared_prompts import start_server  # noqa: E402  (the one way scripts start a server)

SURFACES = ("chat", "responses", "messages")


def request(surface: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one streamed greedy request."""
    messages = [{"role": "user", "content": prompt}]
    if surface == "chat":
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens,
                                        "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}}
    if surface == "responses":
        return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens,
                                 "temperature": 0, "stream": True, "store": False}
    return "/v1/messages", {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}


def text_and_tokens(surface: str, event: dict) -> tuple[str, int | None]:
    """The text an event carries, and the completion tokens it reports (the last event's usage)."""
    if surface == "chat":
        usage = event.get("usage") or {}
        text = "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or [])
        return text, usage.get("completion_tokens")
    kind = event.get("type")
    if surface == "responses":
        if kind == "response.output_text.delta":
            return event["delta"], None
        if kind in ("response.completed", "response.incomplete"):
            return "", event["response"]["usage"]["output_tokens"]
        return "", None
    if kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
        return event["delta"]["text"], None
    if kind == "message_delta":
        return "", event["usage"]["output_tokens"]
    return "", None


def measure(client: httpx.Client, surface: str, model: str, prompt: str, max_tokens: int) -> dict:
    path, body = request(surface, model, prompt, max_tokens)
    sent = time.perf_counter()
    first = last = None
    pieces, tokens = [], None
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text, reported = text_and_tokens(surface, json.loads(line[6:]))
            now = time.perf_counter()
            if text:
                first = first if first is not None else now
                last = now
                pieces.append(text)
            if reported is not None:
                tokens = reported
    decode = (tokens - 1) / (last - first) if tokens and first is not None and last > first else None
    return {"surface": surface, "text": "".join(pieces), "tokens": tokens, "ttft": first - sent if first else None,
            "decode_tok_s": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", help="write every record here (JSONL)")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    prompts = load_prompts(SPEC_BENCH, per_category=args.per_category)
    port = free_port()
    server = start_server(port, extra)
    records = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for repeat in range(args.repeats):
                for i, prompt in enumerate(prompts):
                    shift = (i + repeat) % len(SURFACES)
                    for surface in SURFACES[shift:] + SURFACES[:shift]:
                        text = f"Request {repeat}-{i}.\n{prompt.text}"
                        record = measure(client, surface, model, text, args.max_tokens)
                        records.append({**record, "prompt": i, "repeat": repeat, "category": prompt.category})
                        print(f"{repeat} {i:2d} {surface:9s} {record['tokens']} tokens, "
                              f"{record['decode_tok_s'] or 0:.2f} tok/s", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    if args.out:
        with open(args.out, "w") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
    report(records)


def report(records: list[dict]) -> None:
    info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                if ":" in line)
    info = {key.strip(): value.strip() for key, value in info.items()}
    flags = set(info.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    cpu = (f"{info.get('model name', platform.processor())} (family {info.get('cpu family')} model "
           f"{info.get('model')}, {isa}{', AMX' if 'amx_tile' in flags else ''})")
    print(f"\nCPU: {cpu}; {len(records)} requests")
    by = {(r["prompt"], r["repeat"], r["surface"]): r for r in records}
    for surface in SURFACES:
        rates = [r["decode_tok_s"] for r in records if r["surface"] == surface and r["decode_tok_s"]]
        ratios = [by[(p, k, surface)]["decode_tok_s"] / by[(p, k, "chat")]["decode_tok_s"]
                  for (p, k, s) in by if s == surface
                  if by[(p, k, surface)]["decode_tok_s"] and by[(p, k, "chat")]["decode_tok_s"]]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"{surface:9s} decode tok/s median {statistics.median(rates):.2f} "
              f"(min {min(rates):.2f}, max {max(rates):.2f}); vs chat per request median "
              f"{statistics.median(ratios):.3f}x (IQR {quartiles[0]:.3f}-{quartiles[2]:.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f})")
    same = sum(by[(p, k, "chat")]["text"] == by[(p, k, s)]["text"] for (p, k, s) in by if s != "chat")
    print(f"texts equal to chat's: {same}/{len(records) - len(records) // len(SURFACES)}")


if __name__ == "__main__":
    main()
