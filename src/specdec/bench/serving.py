"""`specdec bench --server`: what a user of `make serve` gets, through HTTP, beside llama-server.

Every server under test is started once and left idle while another is measured: one `specdec
serve` (the method is chosen per request, `speculative_decoding`), and one llama-server per
peer configuration (`-np` as many slots as the highest concurrency). For each concurrency level
the prompts are sent in waves of that many concurrent streams (every prompt runs at every
level), configurations interleaved wave by wave in an order that alternates between repeats.
Each request records its time to first token, the gaps between its chunks, its tokens and its
text, so texts can be compared with the same request at one stream. Records never raise: a
failed request is a record with its error.

With `engine`, each method also runs at one stream on an engine in the benchmark's own process,
as `specdec generate` runs it (`engine:METHOD`), interleaved with the HTTP requests: the server's
tax is the ratio of the two.

Per level and configuration the report gives aggregate tok/s (every token of the level over its
waves' wall time, prompt processing included), per-stream decode tok/s (tokens after the first
over the time after it), TTFT and chunk gaps at p50/p95, and the texts that differ from one stream's.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import httpx

from specdec.bench.datasets import BenchPrompt
from specdec.bench.peers import LlamaServer, ServerOptions
from specdec.client.structured import schema_valid
from specdec.client.tables import markdown_table
from specdec.types import SpecdecError

STARTUP_SECONDS = 900.0  # a fresh specdec serve may calibrate first


@dataclass(frozen=True)
class ServedConfig:
    label: str  # e.g. "specdec:auto", "llama-server:ngram-simple:k3"
    url: str
    method: Optional[str] = None  # specdec's speculative_decoding method; None for a peer
    model: str = "default"  # what the server's /v1/models lists
    engine: object = None  # an in-process engine: the request runs as `specdec generate` runs it


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest rank (a value that occurred), not client/tables.py's interpolation: its published tables used this."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def one_request(client: httpx.AsyncClient, config: ServedConfig, prompt: BenchPrompt, max_tokens: int) -> dict:
    body = {"model": config.model, "messages": list(prompt.messages), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if config.method is not None:
        body["speculative_decoding"] = {"method": config.method}
    # Every server processes every prompt: no prompt cached by another configuration's wave.
    body["cache_prompt"] = False
    if prompt.response_format is not None:
        body["response_format"] = prompt.response_format
    record = {"config": config.label, "prompt_id": prompt.id, "category": prompt.category, "error": None}
    started = time.perf_counter()
    chunks: list[float] = []
    text, usage = [], None
    try:
        async with client.stream("POST", config.url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    record["error"] = json.dumps(chunk["error"])[:300]
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        chunks.append(time.perf_counter())
                        text.append(content)
    except httpx.HTTPError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        return record
    ended = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or len(chunks)
    record["server_decode_tokens_per_second"] = ((usage or {}).get("speculative") or {}).get("tokens_per_second")
    record.update(text="".join(text), tokens=tokens, seconds=ended - started,
                  ttft=(chunks[0] - started) if chunks else None,
                  decode_tokens_per_second=((tokens - 1) / (chunks[-1] - chunks[0])
                                            if len(chunks) > 1 and chunks[-1] > chunks[0] else None),
                  chunk_gaps=[b - a for a, b in zip(chunks, chunks[1:])])
    if prompt.response_format is not None:
        record["schema_valid"] = schema_valid(record["text"], prompt.response_format)
    return record



def engine_request(config: ServedConfig, prompt: BenchPrompt, max_tokens: int) -> dict:
    from specdec.bench.runner import reset_between_generations
    from specdec.types import GenerationRequest, SpecConfig

    engine = config.engine
    reset_between_generations(engine)  # as a fresh `specdec generate`: nothing cached, no history
    ids = tuple(engine.encode_prompt(list(prompt.messages), chat=True))
    started = time.perf_counter()
    result = engine.generate(GenerationRequest(ids, max_tokens, spec=SpecConfig(config.method)))
    stats = result.stats
    return {"config": config.label, "prompt_id": prompt.id, "category": prompt.category, "error": None,
            "text": result.text, "tokens": len(result.token_ids), "seconds": time.perf_counter() - started,
            "ttft": stats.get("ttft_seconds"), "decode_tokens_per_second": stats.get("tokens_per_second"),
            "chunk_gaps": []}


async def run_wave(config: ServedConfig, prompts: Sequence[BenchPrompt], max_tokens: int) -> tuple[list[dict], float]:
    if config.engine is not None:
        started = time.perf_counter()
        return [engine_request(config, p, max_tokens) for p in prompts], time.perf_counter() - started
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        started = time.perf_counter()
        records = await asyncio.gather(*(one_request(client, config, p, max_tokens) for p in prompts))
        return list(records), time.perf_counter() - started


def run_levels(configs: Sequence[ServedConfig], prompts: Sequence[BenchPrompt], levels: Sequence[int],
               max_tokens: int, repeats: int, records_path: Path, progress=print) -> list[dict]:
    """Every prompt at every level, in waves of `level` streams, configurations interleaved."""
    records = []
    with open(records_path, "a", encoding="utf-8") as out:
        for level in levels:
            waves = [prompts[i:i + level] for i in range(0, len(prompts) - level + 1, level)]
            for repeat in range(repeats):
                order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
                for index, wave in enumerate(waves):
                    for config in (order if index % 2 == 0 else order[::-1]):
                        if config.engine is not None and level > 1:
                            continue  # the engine alone serves one stream
                        results, wall = asyncio.run(run_wave(config, wave, max_tokens))
                        for result in results:
                            result.update(level=level, repeat=repeat, wave=index, wave_seconds=wall)
                            out.write(json.dumps(result, ensure_ascii=False) + "\n")
                        out.flush()
                        records += results
                progress(f"level {level}, repeat {repeat + 1}/{repeats} done")
    return records


def summarize(records: Sequence[dict], configs: Sequence[ServedConfig], levels: Sequence[int]) -> list[dict]:
    rows = []
    for config in configs:
        alone = {r["prompt_id"]: r.get("text") for r in records
                 if r["config"] == config.label and r["level"] == min(levels) and r["repeat"] == 0 and not r["error"]}
        for level in levels:
            mine = [r for r in records if r["config"] == config.label and r["level"] == level]
            if not mine:
                continue
            ok = [r for r in mine if not r["error"]]
            walls = {(r["repeat"], r["wave"]): r["wave_seconds"] for r in mine}
            decode = [r["decode_tokens_per_second"] for r in ok if r.get("decode_tokens_per_second")]
            server_decode = [r["server_decode_tokens_per_second"] for r in ok if r.get("server_decode_tokens_per_second")]
            ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
            gaps = [g for r in ok for g in r.get("chunk_gaps", ())]
            compared = [r for r in ok if r["prompt_id"] in alone]
            rows.append({
                "config": config.label, "level": level, "requests": len(mine), "errors": len(mine) - len(ok),
                "aggregate_tokens_per_second": sum(r["tokens"] for r in ok) / sum(walls.values()) if walls else None,
                "decode_tokens_per_second_median": statistics.median(decode) if decode else None,
                "decode_tokens_per_second_p25": percentile(decode, 0.25),
                "decode_tokens_per_second_p75": percentile(decode, 0.75),
                "aggregate_decode_tokens_per_second": (statistics.median(decode) * level) if decode else None,
                "server_decode_tokens_per_second_median": statistics.median(server_decode) if server_decode else None,
                "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
                "chunk_gap_p50": percentile(gaps, 0.5), "chunk_gap_p95": percentile(gaps, 0.95),
                "texts_as_one_stream": f"{sum(r['text'] == alone[r['prompt_id']] for r in compared)}/{len(compared)}",
            })
    return rows


def format_table(rows: Sequence[dict]) -> str:
    def cell(value, digits=2):
        return "—" if value is None else f"{value:.{digits}f}"

    def gaps(r: dict) -> str:
        return "—" if r["chunk_gap_p50"] is None else f"{r['chunk_gap_p50'] * 1e3:.0f}/{r['chunk_gap_p95'] * 1e3:.0f}"

    header = ["config", "streams", "aggregate tok/s", "decode tok/s per stream, median (IQR)", "streams x median decode",
              "engine's own decode tok/s", "TTFT p50/p95 s", "chunk gap p50/p95 ms", "texts as at 1 stream", "errors"]
    return "\n".join(markdown_table(header, [
        [r["config"], r["level"], cell(r["aggregate_tokens_per_second"]),
         f"{cell(r['decode_tokens_per_second_median'])} ({cell(r['decode_tokens_per_second_p25'])}–"
         f"{cell(r['decode_tokens_per_second_p75'])})", cell(r["aggregate_decode_tokens_per_second"]),
         cell(r["server_decode_tokens_per_second_median"]), f"{cell(r['ttft_p50'])}/{cell(r['ttft_p95'])}", gaps(r),
         r["texts_as_one_stream"], r["errors"]]
        for r in rows]))


class SpecdecServer:
    """`specdec serve` in a subprocess on a free port, until stopped."""

    def __init__(self, slots: int, extra_args: Sequence[str], log_path: Path):
        from specdec.server.testing import free_port  # here: specdec.server loads the whole app

        self.port = free_port()
        self.log_path = log_path
        self.command = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(self.port),
                        "--parallel", str(slots), *extra_args]
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "SpecdecServer":
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecdecError(f"specdec serve exited with code {self.process.returncode}; see {self.log_path}.")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise SpecdecError(f"specdec serve was not healthy after {STARTUP_SECONDS:.0f}s; see {self.log_path}.")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def llama_server_options(binary: str, target: str, draft: Optional[str], slots: int, spec: str) -> ServerOptions:
    """spec: "plain", "ngram-simple:kK" or "draft:kK" (its draft model)."""
    if spec == "plain":
        return ServerOptions(binary, target, slots=slots)
    kind, _, k = spec.partition(":k")
    if kind == "draft":
        return ServerOptions(binary, target, draft=draft, num_draft_tokens=int(k), spec_type="draft-simple", slots=slots)
    return ServerOptions(binary, target, num_draft_tokens=int(k), spec_type=kind, slots=slots)


def run(prompts: Sequence[BenchPrompt], methods: Sequence[str], levels: Sequence[int], max_tokens: int,
        repeats: int, out: Path, serve_args: Sequence[str], llama_server: Optional[str],
        llama_server_specs: Sequence[str], target: str, draft: Optional[str], engine=None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    slots = max(levels)
    peers = [LlamaServer(llama_server_options(llama_server, target, draft, slots, spec), out / f"llama-server-{spec}.log")
             for spec in llama_server_specs] if llama_server else []
    with SpecdecServer(slots, serve_args, out / "specdec-serve.log") as server:
        started = []
        try:
            for peer in peers:
                started.append(peer.start())
            configs = [ServedConfig(f"specdec:{method}", server.url, method, served_model(server.url)) for method in methods]
            configs += [ServedConfig(f"llama-server:{spec}", peer.url, model=served_model(peer.url))
                        for spec, peer in zip(llama_server_specs, started)]
            if engine is not None:
                configs += [ServedConfig(f"engine:{method}", "", method, engine=engine) for method in methods]
            for config in configs:  # warm-up, unrecorded
                asyncio.run(run_wave(config, prompts[:1], 8))
            records = run_levels(configs, prompts, levels, max_tokens, repeats, out / "server-records.jsonl")
        finally:
            for peer in started:
                peer.stop()
    rows = summarize(records, configs, levels)
    (out / "server-report.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    (out / "server-report.md").write_text(format_table(rows) + "\n", encoding="utf-8")
    return rows
