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
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import httpx

from specdec.bench.datasets import BenchPrompt
from specdec.bench.peers import LlamaServer, ServerOptions
from specdec.client.structured import schema_valid
from specdec.client.records import Layout, RequestRecord, stream_timing
from specdec.client.render import NEAREST_RANK, Cells, fields, markdown_table, spread
from specdec.types import SpecdecError

STARTUP_SECONDS = 900.0  # a fresh specdec serve may calibrate first


@dataclass(frozen=True)
class ServedConfig:
    label: str  # e.g. "specdec:auto", "llama-server:ngram-simple:k3"
    url: str
    method: Optional[str] = None  # specdec's speculative_decoding method; None for a peer
    model: str = "default"  # what the server's /v1/models lists
    engine: object = None  # an in-process engine: the request runs as `specdec generate` runs it


SERVED_LAYOUT = Layout(
    keys=("config", "prompt_id", "category", "error", "server_decode_tokens_per_second", "text", "tokens", "seconds",
          "ttft", "decode_tokens_per_second", "chunk_gaps", "schema_valid"),
    measured={"error": "error", "text": "text", "tokens": "completion_tokens", "seconds": "wall_seconds",
              "ttft": "ttft_seconds", "decode_tokens_per_second": "decode_tokens_per_second"},
)


def served_record(config: ServedConfig, prompt: BenchPrompt, measured: RequestRecord) -> dict:
    """A server-records.jsonl line (run_levels adds the level, repeat and wave)."""
    identity = {"config": config.label, "prompt_id": prompt.id, "category": prompt.category}
    return measured.with_fields(**identity).as_dict(SERVED_LAYOUT)


async def one_request(client: httpx.AsyncClient, config: ServedConfig, prompt: BenchPrompt, max_tokens: int) -> dict:
    body = {"model": config.model, "messages": list(prompt.messages), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if config.method is not None:
        body["speculative_decoding"] = {"method": config.method}
    # Every server processes every prompt: no prompt cached by another configuration's wave.
    body["cache_prompt"] = False
    if prompt.response_format is not None:
        body["response_format"] = prompt.response_format
    try:
        measured = await _stream(client, config.url, body)
    except httpx.HTTPError as exc:
        measured = RequestRecord(error=f"{type(exc).__name__}: {exc}")
    if measured.text is not None and prompt.response_format is not None:
        measured = measured.with_fields(schema_valid=schema_valid(measured.text, prompt.response_format))
    return served_record(config, prompt, measured)


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> RequestRecord:
    """One streamed chat completion, each chunk of text timed as it arrives."""
    started = time.perf_counter()
    chunks: list[float] = []
    text, usage, timings, error = [], None, None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return RequestRecord(error=f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                error = json.dumps(chunk["error"])[:300]
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):  # llama-server's, cache_n among them
                timings = chunk["timings"]
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chunks.append(time.perf_counter())
                    text.append(content)
    ended = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or len(chunks)
    timing = stream_timing([(t, 1) for t in chunks], started, tokens)  # an HTTP chunk's token count is unknown
    own = {"server_decode_tokens_per_second": ((usage or {}).get("speculative") or {}).get("tokens_per_second"),
           "chunk_gaps": [b - a for a, b in zip(chunks, chunks[1:])]}
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = (timings or {}).get("cache_n")
    return RequestRecord(text="".join(text), completion_tokens=tokens, prompt_tokens=(usage or {}).get("prompt_tokens"),
                         error=error, wall_seconds=ended - started, ttft_seconds=timing.ttft_seconds,
                         decode_tokens_per_second=timing.decode_tokens_per_second, stats={"cached_tokens": cached},
                         fields=own)


def engine_request(config: ServedConfig, prompt: BenchPrompt, max_tokens: int) -> dict:
    from specdec.bench.runner import reset_between_generations
    from specdec.types import GenerationRequest, SpecConfig

    engine = config.engine
    reset_between_generations(engine)  # as a fresh `specdec generate`: nothing cached, no history
    ids = tuple(engine.encode_prompt(list(prompt.messages), chat=True))
    started = time.perf_counter()
    result = engine.generate(GenerationRequest(ids, max_tokens, spec=SpecConfig(config.method)))
    stats = result.stats
    return served_record(config, prompt, RequestRecord(
        text=result.text, completion_tokens=len(result.token_ids), wall_seconds=time.perf_counter() - started,
        ttft_seconds=stats.get("ttft_seconds"), decode_tokens_per_second=stats.get("tokens_per_second"),
        fields={"chunk_gaps": []}))


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
            decode = spread([r["decode_tokens_per_second"] for r in ok if r.get("decode_tokens_per_second")],
                            NEAREST_RANK)
            server_decode = spread([r["server_decode_tokens_per_second"] for r in ok
                                    if r.get("server_decode_tokens_per_second")])
            ttft = fields(spread([r["ttft"] for r in ok if r.get("ttft") is not None], NEAREST_RANK), ("p50", "p95"))
            gaps = fields(spread([g for r in ok for g in r.get("chunk_gaps", ())], NEAREST_RANK), ("p50", "p95"))
            decode_fields = fields(decode, ("median", "p25", "p75"))
            compared = [r for r in ok if r["prompt_id"] in alone]
            rows.append({
                "config": config.label, "level": level, "requests": len(mine), "errors": len(mine) - len(ok),
                "aggregate_tokens_per_second": sum(r["tokens"] for r in ok) / sum(walls.values()) if walls else None,
                "decode_tokens_per_second_median": decode_fields["median"],
                "decode_tokens_per_second_p25": decode_fields["p25"],
                "decode_tokens_per_second_p75": decode_fields["p75"],
                "aggregate_decode_tokens_per_second": decode.median * level if decode else None,
                "server_decode_tokens_per_second_median": fields(server_decode, ("median",))["median"],
                "ttft_p50": ttft["p50"], "ttft_p95": ttft["p95"],
                "chunk_gap_p50": gaps["p50"], "chunk_gap_p95": gaps["p95"],
                "texts_as_one_stream": f"{sum(r['text'] == alone[r['prompt_id']] for r in compared)}/{len(compared)}",
            })
    return rows


def format_table(rows: Sequence[dict]) -> str:
    cells = Cells()

    def gaps(r: dict) -> str:
        return cells.missing if r["chunk_gap_p50"] is None else \
            f"{r['chunk_gap_p50'] * 1e3:.0f}/{r['chunk_gap_p95'] * 1e3:.0f}"

    header = ["config", "streams", "aggregate tok/s", "decode tok/s per stream, median (IQR)", "streams x median decode",
              "engine's own decode tok/s", "TTFT p50/p95 s", "chunk gap p50/p95 ms", "texts as at 1 stream", "errors"]
    return "\n".join(markdown_table(header, [
        [r["config"], r["level"], cells.number(r["aggregate_tokens_per_second"]),
         f"{cells.number(r['decode_tokens_per_second_median'])} ({cells.number(r['decode_tokens_per_second_p25'])}–"
         f"{cells.number(r['decode_tokens_per_second_p75'])})", cells.number(r["aggregate_decode_tokens_per_second"]),
         cells.number(r["server_decode_tokens_per_second_median"]),
         f"{cells.number(r['ttft_p50'])}/{cells.number(r['ttft_p95'])}", gaps(r), r["texts_as_one_stream"], r["errors"]]
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


@contextmanager
def started_configs(prompts: Sequence[BenchPrompt], methods: Sequence[str], slots: int, out: Path,
                    serve_args: Sequence[str], llama_server: Optional[str], llama_server_specs: Sequence[str],
                    target: str, draft: Optional[str], engine=None) -> Iterator[list[ServedConfig]]:
    """Every server under test started and warmed up (one unrecorded request each), as the
    configurations to measure; all stopped when the block ends. One `specdec serve --parallel
    SLOTS` serves every method, one `llama-server -np SLOTS` each peer spec; each stays idle while
    another is measured. Used by the waves (`run`) and the request-rate runs (bench/rates.py)."""
    out.mkdir(parents=True, exist_ok=True)
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
            yield configs
        finally:
            for peer in started:
                peer.stop()


def run(prompts: Sequence[BenchPrompt], methods: Sequence[str], levels: Sequence[int], max_tokens: int,
        repeats: int, out: Path, serve_args: Sequence[str], llama_server: Optional[str],
        llama_server_specs: Sequence[str], target: str, draft: Optional[str], engine=None) -> list[dict]:
    with started_configs(prompts, methods, max(levels), out, serve_args, llama_server, llama_server_specs, target,
                         draft, engine) as configs:
        records = run_levels(configs, prompts, levels, max_tokens, repeats, out / "server-records.jsonl")
    rows = summarize(records, configs, levels)
    (out / "server-report.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    (out / "server-report.md").write_text(format_table(rows) + "\n", encoding="utf-8")
    return rows
