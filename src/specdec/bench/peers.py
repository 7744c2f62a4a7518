"""Peers: other engines measured on the same prompts in the same run, reported beside ours.

`llama-server=PATH` starts llama.cpp's own server on loopback, once without a draft and once per
draft length K of the run's `draft` configurations (`-md DRAFT --spec-type draft-simple
--spec-draft-n-max K`), sends every prompt as chat messages to /v1/chat/completions (greedy when
the run is, same max tokens, no prompt cache) and records the server's own `timings`.
`hf-assisted` is the hook for the PyTorch backend's assisted generation; until that backend
exists it reports "not run". A peer that is not run is reported as such, never estimated.
"""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

from specdec.bench.datasets import BenchPrompt
from specdec.bench.records import RecordFile
from specdec.bench.runner import WARMUP_MAX_TOKENS, RunSettings
from specdec.types import SpecdecError

log = logging.getLogger(__name__)

LLAMA_SERVER = "llama-server"
HF_ASSISTED = "hf-assisted"
PEERS = (LLAMA_SERVER, HF_ASSISTED)
RUN = "run"
NOT_GIVEN = "not run: no binary given (--peer llama-server=PATH)"
HF_NOT_READY = "not run: needs the PyTorch backend"
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 1800.0


def parse_peers(values: Optional[Sequence[str]]) -> dict[str, Optional[str]]:
    """`--peer` values -> {peer name: binary path or None}. Example: ["llama-server=/x"] -> {"llama-server": "/x"}."""
    peers: dict[str, Optional[str]] = {}
    for value in values or ():
        name, _, path = value.partition("=")
        if name not in PEERS:
            raise SpecdecError(f"unknown peer {name!r}; choose llama-server=PATH or hf-assisted.")
        if name == LLAMA_SERVER:
            if not path:
                raise SpecdecError("--peer llama-server needs the binary: --peer llama-server=PATH.")
            if not Path(path).is_file():
                raise SpecdecError(f"llama-server binary {path} does not exist (scripts/build_llama_server.sh builds one).")
        peers[name] = path or None
    return peers


def peer_status(peers: dict[str, Optional[str]]) -> dict[str, str]:
    """A status line per known peer: "run", or why it was not run."""
    return {
        LLAMA_SERVER: RUN if peers.get(LLAMA_SERVER) else NOT_GIVEN,
        HF_ASSISTED: HF_NOT_READY,  # the hook for the PyTorch backend; requested or not, it cannot run yet
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerOptions:
    binary: str
    target: str
    draft: Optional[str] = None  # None: the run without a draft
    num_draft_tokens: int = 0
    ctx_size: int = 4096
    threads: Optional[int] = None

    def command(self, port: int) -> list[str]:
        cmd = [self.binary, "-m", self.target, "--host", "127.0.0.1", "--port", str(port),
               "-c", str(self.ctx_size), "-np", "1", "--no-webui"]
        if self.threads:
            cmd += ["-t", str(self.threads)]
        if self.draft is not None:
            cmd += ["-md", self.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(self.num_draft_tokens)]
        return cmd


class LlamaServer:
    """One llama-server process on a free loopback port, stopped on exit."""

    def __init__(self, options: ServerOptions, log_path: Path, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.options = options
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def start(self) -> "LlamaServer":
        """Start the process and wait until /health answers 200 (stops it again on failure)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(self.options.command(self.port), stdout=log_file,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log_file.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecdecError(f"llama-server exited with code {self.process.returncode} while starting; "
                                   f"see {self.log_path}.")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.5)
        raise SpecdecError(f"llama-server was not healthy after {self.startup_timeout:.0f}s; see {self.log_path}.")

    def chat(self, messages: Sequence[dict], max_tokens: int, temperature: float, seed: Optional[int]) -> dict:
        body = {"messages": list(messages), "max_tokens": max_tokens, "temperature": temperature,
                "cache_prompt": False, "stream": False}
        if seed is not None:
            body["seed"] = seed
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", errors="replace")[:500]
            raise SpecdecError(f"llama-server answered HTTP {exc.code}: {detail}") from None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def peer_record(prompt: BenchPrompt, label: str, method: str, k: int, repeat: int) -> dict:
    return {
        "source": LLAMA_SERVER, "prompt_id": prompt.id, "category": prompt.category, "config": label,
        "method": method, "num_draft_tokens": k, "repeat": repeat, "success": False, "error": None,
        "prompt_tokens": None, "output_token_ids": [], "text": None, "finish_reason": None,
        "wall_seconds": None, "stats": None, "timings": None,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def stats_from_timings(timings: dict) -> dict:
    """llama-server's timings under the names the engine's stats use."""
    drafted = timings.get("draft_n")
    accepted = timings.get("draft_n_accepted")
    prompt_ms = timings.get("prompt_ms")
    predicted_ms = timings.get("predicted_ms")
    return {
        "prompt_tokens": timings.get("prompt_n"),
        "generated_tokens": timings.get("predicted_n"),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "prompt_seconds": prompt_ms / 1000 if prompt_ms is not None else None,
        "total_seconds": (prompt_ms + predicted_ms) / 1000 if prompt_ms is not None and predicted_ms is not None else None,
        "tokens_per_second": timings.get("predicted_per_second"),
    }


def run_llama_server(
    binary: str,
    prompts: Sequence[BenchPrompt],
    draft_ks: Sequence[int],
    settings: RunSettings,
    records: RecordFile,
    target: str,
    draft: Optional[str],
    log_dir: Path,
    ctx_size: int = 4096,
    threads: Optional[int] = None,
    progress: bool = True,
    startup_timeout: float = STARTUP_TIMEOUT_S,
) -> dict:
    """Measure llama-server without a draft and with each K; one record per (prompt, config, repeat)."""
    from tqdm import tqdm

    runs = [(f"{LLAMA_SERVER}:off", "off", 0, None)]
    if draft is not None:
        runs += [(f"{LLAMA_SERVER}:draft:k{k}", "draft", k, draft) for k in draft_ks]
    counts = {"measured": 0, "failed": 0}
    seed = None if settings.greedy else settings.seed
    for label, method, k, draft_path in runs:
        todo = [(p, r) for p in prompts for r in range(settings.repeats) if (p.id, label, r) not in records]
        if not todo:
            continue
        options = ServerOptions(binary, target, draft_path, k, ctx_size, threads)
        log_path = Path(log_dir) / f"{label.replace(':', '-')}.log"
        try:
            server = LlamaServer(options, log_path, startup_timeout).start()
        except Exception as exc:
            for prompt, repeat in todo:
                record = peer_record(prompt, label, method, k, repeat)
                record["error"] = f"llama-server did not start: {exc}"
                records.append(record)
                counts["failed"] += 1
            continue
        try:
            for _ in range(settings.warmup):
                try:
                    server.chat(list(prompts[0].messages), min(settings.max_tokens, WARMUP_MAX_TOKENS), settings.temperature, seed)
                except Exception as exc:
                    log.warning("llama-server warm-up failed: %s", exc)
            with tqdm(total=len(todo), unit="req", desc=label, file=sys.stderr, disable=not progress,
                      dynamic_ncols=True) as bar:
                for prompt, repeat in todo:
                    record = peer_record(prompt, label, method, k, repeat)
                    started = time.perf_counter()
                    try:
                        response = server.chat(list(prompt.messages), settings.max_tokens, settings.temperature,
                                               None if seed is None else seed + repeat)
                        record["wall_seconds"] = time.perf_counter() - started
                        choice = response["choices"][0]
                        timings = response.get("timings") or {}
                        record.update(success=True, text=choice["message"]["content"],
                                      finish_reason=choice.get("finish_reason"), timings=timings,
                                      stats=stats_from_timings(timings))
                        record["prompt_tokens"] = record["stats"]["prompt_tokens"]
                    except Exception as exc:
                        record["error"] = f"{type(exc).__name__}: {exc}"
                        counts["failed"] += 1
                    records.append(record)
                    counts["measured"] += 1
                    bar.update(1)
        finally:
            server.stop()
    return counts
