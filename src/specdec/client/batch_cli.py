"""`specdec batch`: run a JSONL batch against an OpenAI-compatible endpoint, resumably, and report it.

    specdec batch prompts.jsonl --out results.jsonl --concurrency 4 --max-tokens 128 \\
        --report report.md --machine-hour-price 0.80 --compare

Rerunning the same command resumes: done ids are skipped, failed ones are retried. Exit status 0
when every request succeeded, 1 when some failed (they are recorded; rerun to retry them), bad input
lines included (each an InputError record naming its line), 2 when nothing could run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from specdec.client.batch import BatchItem, BatchSettings, ProgressHook, read_input, run_batch, usage_count
from specdec.client.cost import load_price_table
from specdec.client.http import DEFAULT_BASE_URL, APIError, AsyncClient, RetryPolicy, Timeouts
from specdec.client.report import build_report, json_path_for, summarize_file, summary_text, write_report
from specdec.drafters.registry import method_names
from specdec.types import SpecdecError


def speculative_choices() -> tuple[str, ...]:
    """`on` (the server's method), or a drafting method by name."""
    return ("on", *method_names())


API_KEY_ENV = ("SPECDEC_API_KEY", "OPENAI_API_KEY")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="INPUT.jsonl", help="one request per line: id plus messages or prompt")
    parser.add_argument("--out", required=True, metavar="RESULTS.jsonl", help="results, appended; rerun to resume")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, metavar="URL",
                        help=f"API base URL, /v1 included (default {DEFAULT_BASE_URL})")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="bearer token (default: $SPECDEC_API_KEY or $OPENAI_API_KEY)")
    parser.add_argument("--model", default=None, metavar="M", help="model name (default: the first one GET /models lists)")
    parser.add_argument("--concurrency", type=int, default=1, metavar="N", help="requests in flight at once (default 1)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="max_tokens for lines that set none (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="temperature for lines that set none (default: the server's)")
    parser.add_argument("--speculative", choices=speculative_choices(), default=None,
                        help="speculative_decoding for every request: on, off or a method (default: the server's)")
    parser.add_argument("--report", default=None, metavar="report.md",
                        help="write report.md and report.json beside it")
    parser.add_argument("--prices", default=None, metavar="FILE",
                        help="price table overriding the shipped one, model by model")
    parser.add_argument("--machine-hour-price", type=float, default=None, metavar="USD",
                        help="price of the serving machine per hour, for compute pricing")
    parser.add_argument("--compare", action="store_true",
                        help="run with speculation off, then on, into RESULTS.off.jsonl and RESULTS.on.jsonl, "
                             "and compare")
    parser.add_argument("--max-attempts", type=int, default=RetryPolicy.max_attempts, metavar="N",
                        help=f"attempts per request, first included (default {RetryPolicy.max_attempts})")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="fixed time limit per attempt (default: scaled with max_tokens, see --per-token-timeout)")
    parser.add_argument("--connect-timeout", type=float, default=Timeouts.connect, metavar="SECONDS",
                        help=f"seconds to connect (default {Timeouts.connect:g})")
    parser.add_argument("--per-token-timeout", type=float, default=Timeouts.per_token, metavar="SECONDS",
                        help=f"seconds allowed per requested token, on top of connect + {Timeouts.first_token:g}s "
                             f"(default {Timeouts.per_token:g})")
    parser.add_argument("--no-stream", action="store_true", help="do not stream (no time to first token)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


class TqdmProgress(ProgressHook):
    """A progress bar (on stderr, only on a terminal) with live throughput."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled = label, enabled
        self.bar: Optional[tqdm] = None
        self.started = time.monotonic()
        self.tokens = self.failed = self.done = 0

    def start(self, pending: int, skipped: int) -> None:
        if skipped:
            print(f"{self.label + ': ' if self.label else ''}{skipped} already done, {pending} to run", file=sys.stderr)
        self.started = time.monotonic()
        self.bar = tqdm(total=pending, desc=self.label or "batch", unit="req", dynamic_ncols=True,
                        disable=None if self.enabled else True)

    def result(self, record: dict) -> None:
        self.done += 1
        self.failed += record["error"] is not None
        self.tokens += usage_count(record.get("usage"), "completion_tokens")
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s, {self.failed} failed", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_args(args: argparse.Namespace) -> None:
    if args.concurrency < 1:
        raise SpecdecError("--concurrency must be at least 1.")
    if args.max_attempts < 1:
        raise SpecdecError("--max-attempts must be at least 1.")
    if args.max_tokens is not None and args.max_tokens < 0:
        raise SpecdecError("--max-tokens must be >= 0.")
    if args.machine_hour_price is not None and args.machine_hour_price < 0:
        raise SpecdecError("--machine-hour-price must be >= 0.")
    for name in ("timeout", "connect_timeout", "per_token_timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0 and not (name == "per_token_timeout" and value == 0):
            raise SpecdecError(f"--{name.replace('_', '-')} must be > 0.")
    if args.compare and args.speculative == "off":
        raise SpecdecError("--compare runs speculation off and on itself; --speculative names the 'on' side "
                           "(on or a method).")


def compare_paths(out: Path) -> tuple[Path, Path]:
    """RESULTS.jsonl → RESULTS.off.jsonl, RESULTS.on.jsonl."""
    return out.with_name(f"{out.stem}.off{out.suffix}"), out.with_name(f"{out.stem}.on{out.suffix}")


def plan_runs(args: argparse.Namespace) -> list[tuple[str, Path, Optional[str]]]:
    """(label, results file, speculative setting) for each run, baseline first."""
    out = Path(args.out)
    if not args.compare:
        return [("", out, args.speculative)]
    off_path, on_path = compare_paths(out)
    return [("off", off_path, "off"), ("on", on_path, args.speculative or "on")]


def _refuse_writing_the_input(args: argparse.Namespace) -> None:
    """Before anything is written: no results or report file may be the input file itself (by any
    path: a symlink, "..", a hard link)."""
    targets = [("--out", path) for _, path, _ in plan_runs(args)]
    if args.report:
        targets += [("--report", Path(args.report)), ("--report", json_path_for(args.report))]
    for flag, path in targets:
        if _same_file(path, Path(args.input)):
            raise SpecdecError(f"{flag} {path} is the input file {args.input}; give {flag} another path.")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: then they are not one file
        return False


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    _refuse_writing_the_input(args)
    items = read_input(args.input)
    prices = load_price_table(args.prices)
    api_key = args.api_key or next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)
    client = AsyncClient(args.base_url, api_key, retry=RetryPolicy(max_attempts=args.max_attempts),
                         timeouts=Timeouts(connect=args.connect_timeout, per_token=args.per_token_timeout,
                                           total=args.timeout),
                         max_connections=max(args.concurrency, 10))
    runs = plan_runs(args)
    model = asyncio.run(_run_all(client, items, runs, args))
    keys = [item.key for item in items]
    summaries = [summarize_file(path, label=label, keys=keys) for label, path, _ in runs]
    settings = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "speculative": f"off, then {runs[1][2]}" if args.compare else args.speculative,
                "stream": not args.no_stream}
    doc = build_report(summaries, prices, args.machine_hour_price, endpoint=args.base_url, model=model,
                       settings=settings)
    print(summary_text(doc))
    if args.report:
        md_path, json_path = write_report(args.report, doc)
        print(f"report: {md_path} and {json_path}")
    failed = sum(s.failed + s.not_run for s in summaries)
    if failed:
        bad_lines = sum(item.problem is not None for item in items) * len(runs)
        hint = f" ({bad_lines} of them bad input lines: fix those in {args.input})" if bad_lines else ""
        print(f"specdec: {failed} request(s) did not succeed{hint}; rerun the same command to retry them.",
              file=sys.stderr)
        return 1
    return 0


async def _run_all(client: AsyncClient, items: list[BatchItem], runs, args: argparse.Namespace) -> str:
    async with client:
        model = args.model or await _first_model(client)
        for label, path, speculative in runs:
            settings = BatchSettings(model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                                   speculative=speculative, force_speculative=args.compare,
                                   concurrency=args.concurrency, stream=not args.no_stream)
            progress = TqdmProgress(label, enabled=not args.no_progress)
            try:
                await run_batch(client, items, path, settings, progress)
            finally:
                progress.close()
    return model


async def _first_model(client: AsyncClient) -> str:
    try:
        models = await client.models()
    except APIError as exc:
        raise SpecdecError(f"cannot list models at {client.base_url}/models ({exc}); pass --model.") from None
    if not models:
        raise SpecdecError(f"{client.base_url}/models lists no model; pass --model.")
    return models[0]
