"""`specdec bench --server --request-rate ...`: each server configuration under Poisson arrivals.

Where the waves (bench/serving.py) hold a fixed number of streams, a rate run sends a fixed count
of requests (`--num-requests`) at random times, as `vllm bench serve --request-rate` does: the
gaps between sends are exponential with mean 1/rate from a seeded generator (`--seed` plus the
repeat index, so every configuration gets the same schedule in a repeat), and `inf` sends them all
at once. `sweep[:N]` first measures each configuration's saturation (an `inf` run: its request
throughput), then N rates evenly spaced up to it. Before each run, `--warmup-requests` requests are
sent at once and awaited; they are not recorded.

The servers are started as the waves start them (serving.started_configs: one `specdec serve`
for every method, one llama-server per peer spec, `--concurrency`'s highest level as their slots),
and each configuration runs alone while the others are idle, the order alternating between repeats.
Requests are serving.one_request's: streamed, greedy, no prompt cache, one record each.

Per configuration and rate the report gives, as vLLM's benchmark names them: request throughput
(successful requests over the run's wall time, from the first send to the last answer), output
tok/s, goodput (requests/s that met every SLO of `--goodput`), and the mean, median, p90 and p99
of TTFT, TPOT (a request's time after its first token over its tokens after the first), ITL (the
gaps between consecutive chunks of text) and E2EL (the request's whole time), in milliseconds,
percentiles interpolated linearly.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import numpy as np

from specdec.bench.datasets import BenchPrompt
from specdec.client.render import Cells, fields, markdown_table, spread
from specdec.types import SpecdecError

if TYPE_CHECKING:  # bench/cli.py imports this module for its flags: the HTTP client loads when a run starts
    from specdec.bench.serving import ServedConfig

RECORDS_FILE = "rate-records.jsonl"
REPORT_JSON = "rate-report.json"
REPORT_MD = "rate-report.md"
META_FILE = "rate-meta.json"
SLO_KEYS = ("ttft", "tpot", "e2el")  # as vLLM's --goodput names them
STATS = ("mean", "median", "p90", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_SWEEP = 5
INF = math.inf


def add_rate_arguments(parser: argparse.ArgumentParser) -> None:
    rates = parser.add_argument_group("request-rate runs (with --server; bench/rates.py)")
    rates.add_argument("--request-rate", default=None, metavar="RATES",
                       help="in place of the waves, send --num-requests at Poisson arrivals: comma-separated "
                            "requests/s, `inf` (all at once), or sweep[:N] (an `inf` run for saturation, then N "
                            f"rates evenly up to it; default N {DEFAULT_SWEEP})")
    rates.add_argument("--num-requests", type=int, default=100, help="measured requests per rate (default 100)")
    rates.add_argument("--warmup-requests", type=int, default=4,
                       help="requests sent at once before each rate's run, not recorded (default 4)")
    rates.add_argument("--goodput", action="append", default=[], metavar="KEY:MS",
                       help="an SLO for goodput (repeatable): ttft, tpot or e2el, milliseconds, e.g. ttft:500")


# -- what to run -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RatePlan:
    rates: tuple[float, ...] = ()  # requests/s, INF for all at once
    sweep: Optional[int] = None  # N: an `inf` run, then N rates evenly up to its throughput


def parse_request_rate(value: str) -> RatePlan:
    """Examples: "1,2.5,inf" -> rates (1, 2.5, inf); "sweep" -> sweep 5; "sweep:3" -> sweep 3."""
    value = value.strip()
    if value.startswith("sweep"):
        if value == "sweep":
            return RatePlan(sweep=DEFAULT_SWEEP)
        count = value.removeprefix("sweep:")
        if count == value or not count.isdigit() or int(count) < 1:
            raise SpecdecError(f"--request-rate {value!r}: sweep takes a count of rates, e.g. sweep:5.")
        return RatePlan(sweep=int(count))
    rates = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        try:
            rate = float(item)
        except ValueError:
            raise SpecdecError(f"--request-rate {item!r}: give requests/s, `inf` or sweep[:N].") from None
        if not rate > 0 or math.isnan(rate):
            raise SpecdecError(f"--request-rate {item!r}: a rate must be above 0.")
        rates.append(rate)
    if not rates:
        raise SpecdecError("--request-rate needs a rate, `inf` or sweep[:N].")
    return RatePlan(rates=tuple(dict.fromkeys(rates)))


def parse_goodput(values: Sequence[str]) -> dict[str, float]:
    """--goodput values -> {key: seconds}. Example: ["ttft:500", "e2el:2000"] -> {"ttft": 0.5, "e2el": 2.0}."""
    slos: dict[str, float] = {}
    for value in values or ():
        key, _, ms = value.partition(":")
        key = key.strip().lower()
        if key not in SLO_KEYS:
            raise SpecdecError(f"--goodput {value!r}: the key is one of {', '.join(SLO_KEYS)}, e.g. ttft:500.")
        try:
            seconds = float(ms) / 1000
        except ValueError:
            raise SpecdecError(f"--goodput {value!r}: milliseconds after the key, e.g. {key}:500.") from None
        if not seconds > 0 or math.isinf(seconds):
            raise SpecdecError(f"--goodput {value!r}: the SLO must be a positive number of milliseconds.")
        if key in slos:
            raise SpecdecError(f"--goodput gives {key} twice.")
        slos[key] = seconds
    return slos


def sweep_rates(saturation: float, count: int) -> list[float]:
    """`count` rates evenly up to the saturation throughput. Example: (10, 4) -> [2.5, 5, 7.5, 10]."""
    return [saturation * i / count for i in range(1, count + 1)]


def rate_label(rate: float) -> str:
    """Example: inf -> "inf"; 2.5 -> "2.5"; 3.14159 -> "3.14"."""
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """When each of `count` requests is sent, in seconds after the first (sent at 0): exponential
    gaps of mean 1/rate from a generator seeded with `seed`; all at 0 when the rate is inf."""
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(count - 1, 0))
    return [0.0, *(float(t) for t in np.cumsum(gaps))]


# -- one request's figures ---------------------------------------------------------------------------

def time_per_output_token(seconds: Optional[float], ttft: Optional[float], tokens: Optional[int]) -> Optional[float]:
    """(end-to-end - TTFT) / (tokens - 1), None with fewer than 2 tokens. Example: (2.0, 0.5, 4) -> 0.5."""
    if seconds is None or ttft is None or not tokens or tokens < 2:
        return None
    return (seconds - ttft) / (tokens - 1)


def meets_slos(record: Mapping, slos: Mapping[str, float]) -> bool:
    """Whether a request succeeded within every SLO (at most the limit); TPOT counts 0 for a request
    of one token, as vLLM counts it, and a request without a first token misses a TTFT SLO."""
    if record.get("error"):
        return False
    values = {"ttft": record.get("ttft"), "tpot": record.get("tpot") or 0.0, "e2el": record.get("seconds")}
    return all((value := values[key]) is not None and value <= limit for key, limit in slos.items())


# -- running -----------------------------------------------------------------------------------------

async def run_at_rate(config: ServedConfig, prompts: Sequence[BenchPrompt], rate: float, num_requests: int,
                      warmup: int, max_tokens: int, seed: int) -> tuple[list[dict], float]:
    """The warm-up, then `num_requests` sent at their Poisson offsets (prompts in turn); returns the
    measured records (with `index`, `sent` and `ended`, seconds after the first send) and the wall time."""
    import httpx

    from specdec.bench.serving import one_request

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # the client never queues
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        if warmup:
            await asyncio.gather(*(one_request(client, config, prompts[i % len(prompts)], max_tokens)
                                   for i in range(warmup)))
        offsets = poisson_offsets(rate, num_requests, seed)
        started = time.perf_counter()

        async def send(index: int, offset: float) -> dict:
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter() - started
            record = await one_request(client, config, prompts[index % len(prompts)], max_tokens)
            record.update(index=index, sent=sent, ended=time.perf_counter() - started)
            return record

        records = await asyncio.gather(*(send(i, offset) for i, offset in enumerate(offsets)))
        return list(records), time.perf_counter() - started


def run_rates(configs: Sequence[ServedConfig], prompts: Sequence[BenchPrompt], plan: RatePlan, max_tokens: int,
              num_requests: int, warmup: int, repeats: int, seed: int, records_path: Path,
              progress: Callable[[str], None] = print) -> list[dict]:
    """Every configuration at every rate, alone, the order alternating between repeats; with a sweep,
    each configuration's rates follow from its own `inf` run (repeat 0's, not run again there)."""
    records: list[dict] = []
    rates_for: dict[str, list[float]] = {config.label: list(plan.rates) for config in configs}
    with open(records_path, "a", encoding="utf-8") as out:
        def measure(config: ServedConfig, rate: float, repeat: int) -> list[dict]:
            results, wall = asyncio.run(run_at_rate(config, prompts, rate, num_requests, warmup, max_tokens,
                                                    seed + repeat))
            for result in results:
                result.update(rate=rate_label(rate), request_rate=None if math.isinf(rate) else rate, repeat=repeat,
                              run_seconds=wall, tpot=time_per_output_token(result.get("seconds"), result.get("ttft"),
                                                                           result.get("tokens")))
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
            out.flush()
            records.extend(results)
            progress(f"{config.label} at {rate_label(rate)} req/s, repeat {repeat + 1}/{repeats}: "
                     f"{sum(not r['error'] for r in results)}/{len(results)} succeeded in {wall:.1f}s")
            return results

        for repeat in range(repeats):
            for config in (configs if repeat % 2 == 0 else configs[::-1]):
                if plan.sweep is not None and repeat == 0:
                    saturated = measure(config, INF, repeat)
                    saturation = _throughput(saturated, saturated[0]["run_seconds"] if saturated else 0.0)
                    if not saturation:
                        raise SpecdecError(f"{config.label}: no request succeeded at `inf`, so no rates to sweep; "
                                           f"see {records_path}.")
                    rates_for[config.label] = [*sweep_rates(saturation, plan.sweep), INF]
                for rate in rates_for[config.label]:
                    if plan.sweep is not None and repeat == 0 and math.isinf(rate):
                        continue  # measured first
                    measure(config, rate, repeat)
    return records


def _throughput(records: Sequence[dict], seconds: float) -> float:
    return sum(not r["error"] for r in records) / seconds if seconds > 0 else 0.0


# -- the report --------------------------------------------------------------------------------------

def summarize(records: Sequence[dict], slos: Mapping[str, float]) -> list[dict]:
    """One row per configuration (in the order first run) and rate (lowest first, `inf` last), repeats pooled."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["config"], record["rate"]), []).append(record)
    configs = list(dict.fromkeys(config for config, _ in groups))
    rows = []
    for (config, rate), mine in sorted(groups.items(), key=lambda item: (
            configs.index(item[0][0]), INF if item[1][0]["request_rate"] is None else item[1][0]["request_rate"])):
        ok = [r for r in mine if not r["error"]]
        seconds = sum({r["repeat"]: r["run_seconds"] for r in mine}.values())
        values = {"ttft": [r["ttft"] for r in ok if r.get("ttft") is not None],
                  "tpot": [r["tpot"] for r in ok if r.get("tpot") is not None],
                  "itl": [gap for r in ok for gap in r.get("chunk_gaps") or ()],
                  "e2el": [r["seconds"] for r in ok if r.get("seconds") is not None]}
        good = sum(meets_slos(r, slos) for r in mine) if slos else None
        row: dict = {"config": config, "rate": rate, "request_rate": mine[0]["request_rate"], "requests": len(mine),
                     "errors": len(mine) - len(ok), "duration_seconds": seconds,
                     "request_throughput": len(ok) / seconds if seconds else None,
                     "output_tokens_per_second": sum(r["tokens"] or 0 for r in ok) / seconds if seconds else None,
                     "good_requests": good,
                     "goodput": good / seconds if good is not None and seconds else None,
                     "slos_ms": {key: limit * 1000 for key, limit in slos.items()}}
        for metric in METRICS:
            summary = fields(spread([v * 1000 for v in values[metric]]), STATS)
            row.update({f"{metric}_ms_{stat}": summary[stat] for stat in STATS})
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict]) -> str:
    cells = Cells()

    def stats(row: dict, metric: str) -> str:
        return " / ".join(cells.number(row[f"{metric}_ms_{stat}"], ".1f") for stat in STATS)

    header = ["config", "rate req/s", "requests", "errors", "req/s", "output tok/s", "goodput req/s",
              *(f"{name} ms mean / median / p90 / p99" for name in ("TTFT", "TPOT", "ITL", "E2EL"))]
    return "\n".join(markdown_table(header, [
        [r["config"], r["rate"], r["requests"], r["errors"], cells.number(r["request_throughput"]),
         cells.number(r["output_tokens_per_second"], ".1f"), cells.number(r["goodput"]),
         *(stats(r, metric) for metric in METRICS)] for r in rows]))


def write_report(rows: Sequence[dict], slos: Mapping[str, float], out: Path) -> None:
    (out / REPORT_JSON).write_text(json.dumps(list(rows), indent=2) + "\n", encoding="utf-8")
    slo_line = ", ".join(f"{key} <= {limit * 1000:g} ms" for key, limit in slos.items()) or "none given (--goodput)"
    (out / REPORT_MD).write_text(f"Goodput SLOs: {slo_line}.\n\n" + format_table(rows) + "\n", encoding="utf-8")


# -- the command -------------------------------------------------------------------------------------

def with_queue(serve_args: Sequence[str], requests: int) -> list[str]:
    """`specdec serve` flags with a queue for every request sent at once, unless --max-queue is given."""
    given = any(arg == "--max-queue" or arg.startswith("--max-queue=") for arg in serve_args)
    return list(serve_args) if given else [*serve_args, "--max-queue", str(requests)]


def run(args: argparse.Namespace) -> int:
    """`specdec bench --server --request-rate ...` (bench/cli.py sends it here)."""
    from specdec.bench import serving
    from specdec.bench.cli import _machine, _model_paths, _split
    from specdec.bench.datasets import load_prompts
    from specdec.bench.peers import LLAMA_SERVER, parse_peers

    if not args.server:
        raise SpecdecError("--request-rate measures servers: add --server.")
    if args.engine_baseline:
        raise SpecdecError("--engine-baseline goes with the waves (--concurrency), not with --request-rate.")
    plan = parse_request_rate(args.request_rate)
    slos = parse_goodput(args.goodput)
    if args.num_requests < 1 or args.warmup_requests < 0 or args.repeats < 1:
        raise SpecdecError("--num-requests and --repeats must be at least 1, --warmup-requests at least 0.")
    try:
        slots = max(int(level) for level in _split([args.concurrency]))
    except ValueError:
        raise SpecdecError("--concurrency takes comma-separated integers, e.g. 1,2,4,8.") from None
    if slots < 1:
        raise SpecdecError("--concurrency levels must be at least 1.")
    methods = list(dict.fromkeys(m.partition(":")[0] for m in _split([args.methods])))
    prompts = load_prompts(args.dataset, _split(args.categories) or None, args.per_category)
    llama_server = parse_peers(args.peer).get(LLAMA_SERVER)
    target, draft = _model_paths(args, need_draft=True)
    out = Path(args.out)
    serve_args = with_queue(shlex.split(args.serve_args), args.num_requests + args.warmup_requests)
    with serving.started_configs(prompts, methods, slots, out, serve_args, llama_server,
                                 _split([args.llama_server_specs]), target, draft) as configs:
        records = run_rates(configs, prompts, plan, args.max_tokens, args.num_requests, args.warmup_requests,
                            args.repeats, args.seed, out / RECORDS_FILE,
                            progress=lambda line: print(line, file=sys.stderr))
    rows = summarize(records, slos)
    write_report(rows, slos, out)
    (out / META_FILE).write_text(json.dumps({
        "command": "specdec " + shlex.join(sys.argv[1:]), "machine": _machine(), "prompts": len(prompts),
        "request_rate": args.request_rate, "num_requests": args.num_requests, "warmup_requests": args.warmup_requests,
        "slots": slots, "max_tokens": args.max_tokens, "repeats": args.repeats, "seed": args.seed,
        "goodput_slos_ms": {key: limit * 1000 for key, limit in slos.items()}}, indent=2) + "\n", encoding="utf-8")
    print(format_table(rows))
    print(f"specdec bench: request-rate report in {out / REPORT_MD}", file=sys.stderr)
    return 0
