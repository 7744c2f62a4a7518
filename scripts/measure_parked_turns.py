"""Turn 2 of a conversation through HTTP, four ways, on one server with one slot and one parked
start at most (issue 44's "turn-N TTFT after eviction within 1.2x of a slot-resident turn"):

- resident: turn 1, then turn 2 at once (the slot still holds the conversation);
- restored: turn 1, another conversation takes the slot (turn 1's prompt start is parked in the
  KV cache, engine/prompt_cache.py), then turn 2;
- host: turn 1, then two other conversations (the second parks the first other's start, so turn
  1's gives way and is copied to host memory), then turn 2, loaded from the copy;
- cold: the same turn 2 sent with `cache_prompt: false` (processed from its first token).

Each repeat uses conversations of their own (a nonce first), the ways in rotating order. With
`--llama-server PATH`, the same turns go to llama-server too (one slot, its prompt cache in host
memory with `--cache-ram 8192`, its own default besides): each server alone, a fresh one per
repeat, the order of servers alternating. Not run in CI.

    .venv/bin/python scripts/measure_parked_turns.py [--repeats 3] [--method off] [--llama-server PATH] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdec.bench.peers import LlamaServer, ServerOptions
from specdec.bench.serving import SpecdecServer, served_model
from specdec.bench.sessions import PEER_CTX_FLOOR
from specdec.machine_profile import cpu_model_name
from specdec.models.registry import TARGET
from specdec.runtime import resolve_model

HERE = Path(__file__).resolve().parent
WAYS = ("resident", "restored", "host", "cold")


def document(nonce: str, paragraphs: int) -> str:
    """A long first turn: a made-up handbook, distinct per nonce from its first token on."""
    lines = [f"Reference {nonce}. You answer questions about the handbook below, briefly."]
    for i in range(paragraphs):
        lines.append(f"Section {i + 1} ({nonce}): requests of kind {i % 7} go to queue {(i * 13) % 29}; "
                     f"escalate after {(i * 7) % 48 + 2} hours; the owner is team {chr(65 + i % 26)}{i}. "
                     f"Refunds under {(i * 37) % 500 + 20} euros need no approval.")
    return "\n".join(lines)


def turn(client: httpx.Client, url: str, model: str, messages: list, method: str, max_tokens: int,
         cache_prompt: bool = True) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt,
            "speculative_decoding": {"method": method}}
    started, ttft, text, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                text.append(chunk["choices"][0]["delta"]["content"])
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": ttft, "seconds": time.perf_counter() - started, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens", 0)}


def second_turn(client, url, model, way: str, nonce: str, args) -> dict:
    first = [{"role": "user", "content": document(nonce, args.paragraphs) + "\n\nWhich queue takes kind 3?"}]
    answer = turn(client, url, model, first, args.method, args.max_tokens)["text"]
    for other_nonce in {"restored": ["-other"], "host": ["-other", "-third"]}.get(way, []):  # others take the slot
        other = [{"role": "user", "content": document(nonce + other_nonce, args.paragraphs) + "\n\nWho owns section 2?"}]
        turn(client, url, model, other, args.method, args.max_tokens)
    follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And kind 5?"}]
    result = turn(client, url, model, follow, args.method, args.max_tokens, cache_prompt=way != "cold")
    if way in ("restored", "host"):  # greedy: the same text as the same turn processed from its first token
        result["same_text_as_cold"] = result["text"] == turn(client, url, model, follow, args.method,
                                                             args.max_tokens, cache_prompt=False)["text"]
    return result


def summarize(results: dict[str, list[dict]]) -> dict:
    cold = statistics.median(r["ttft"] for r in results["cold"])
    summary: dict = {way: {"ttft_median": statistics.median(r["ttft"] for r in rows),
                           "ttft_range": [min(r["ttft"] for r in rows), max(r["ttft"] for r in rows)],
                           "ttft_vs_cold": statistics.median(r["ttft"] for r in rows) / cold,
                           "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
                           "cached_tokens": statistics.median(r["cached_tokens"] or 0 for r in rows)}
                     for way, rows in results.items()}
    for way in ("restored", "host"):
        summary[f"{way}_vs_resident"] = summary[way]["ttft_median"] / summary["resident"]["ttft_median"]
        summary[f"{way}_texts_as_cold"] = sum(r["same_text_as_cold"] for r in results[way])
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paragraphs", type=int, default=30, help="length of the first turn (about 60 tokens each)")
    parser.add_argument("--method", default="off")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--llama-server", default=None, metavar="PATH", help="also measure this llama-server binary")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="specdec-parked-"))

    def specdec(repeat: int):  # one slot, one parked start at most: the host way's start gives way
        return SpecdecServer(1, ["--method", args.method, "--set", "engine.parked_prompts=1"], logs / f"specdec-{repeat}.log")

    def llama_server(repeat: int):
        target = str(resolve_model(None, TARGET))
        options = ServerOptions(args.llama_server, target, ctx_size=PEER_CTX_FLOOR, slots=1, cache_ram_mib=8192)
        return LlamaServer(options, logs / f"llama-server-{repeat}.log")

    servers = {"specdec": specdec, **({"llama-server": llama_server} if args.llama_server else {})}
    results: dict[str, dict[str, list[dict]]] = {name: {way: [] for way in WAYS} for name in servers}
    # A new connection per request: llama-server closes idle ones at 5 s, racing a client's reuse.
    with httpx.Client(timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for repeat in range(args.repeats):
            names = list(servers)[::-1 if repeat % 2 else 1]
            for name in names:
                with servers[name](repeat) as server:
                    model = served_model(server.url)
                    for offset in range(len(WAYS)):
                        way = WAYS[(repeat + offset) % len(WAYS)]
                        result = second_turn(client, server.url, model, way, f"r{repeat}-{way}", args)
                        results[name][way].append(result)
                        print(json.dumps({"server": name, "repeat": repeat, "way": way,
                                          **{k: v for k, v in result.items() if k != "text"}}), flush=True)
    summary = {"cpu": cpu_model_name(), "method": args.method, "repeats": args.repeats, "logs": str(logs),
               **summarize(results["specdec"])}
    if args.llama_server:
        peer = summary["llama-server"] = summarize(results["llama-server"])
        summary["specdec_vs_llama_server"] = {way: summary[way]["ttft_median"] / peer[way]["ttft_median"]
                                              for way in WAYS}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "turns": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
