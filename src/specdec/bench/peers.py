"""Peers: other engines measured on the same prompts in the same run, reported beside ours.

`llama-server=PATH` starts llama.cpp's own server on loopback, once without a draft, once per
draft length K of the run's `draft` configurations (`-md DRAFT --spec-type draft-simple
--spec-draft-n-max K`) and once per K of its `ngram` configurations (its prompt lookup,
`--spec-type ngram-simple --spec-draft-n-max K`), sends every prompt as chat messages to /v1/chat/completions (greedy when
the run is, same max tokens, no prompt cache) and records the server's own `timings`.
`hf-assisted` runs transformers' own `model.generate` on the models the torch backend loads (same
loader, same chat template, same end-of-generation ids): plain, with the draft model as
`assistant_model` at each draft K (a constant K, no confidence stop: like our draft:kK), and with
`prompt_lookup_num_tokens` at each n-gram K (3 when the run has none). It needs torch and
transformers. A peer that is not run is reported as such, never estimated.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from specdec.bench.datasets import BenchPrompt
from specdec.bench.records import RecordFile, bench_record
from specdec.bench.runner import BASELINE, WARMUP_MAX_TOKENS, BenchSettings
from specdec.client.records import RequestRecord, stream_timing
from specdec.types import SpecdecError

log = logging.getLogger(__name__)

LLAMA_SERVER = "llama-server"
HF_ASSISTED = "hf-assisted"
PEERS = (LLAMA_SERVER, HF_ASSISTED)
RUN = "run"
NOT_GIVEN = "not run: no binary given (--peer llama-server=PATH)"
HF_NOT_GIVEN = "not run: not requested (--peer hf-assisted)"
HF_NOT_INSTALLED = "not run: needs torch and transformers (pip install 'specdec[torch]')"
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
        HF_ASSISTED: (RUN if torch_installed() else HF_NOT_INSTALLED) if HF_ASSISTED in peers else HF_NOT_GIVEN,
    }


def torch_installed() -> bool:
    """Whether the hf-assisted peer can run, found without importing torch."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


@dataclass(frozen=True)
class ServerOptions:
    binary: str
    target: str
    draft: Optional[str] = None  # the draft model's path, for spec_type "draft-simple"
    num_draft_tokens: int = 0
    ctx_size: int = 4096
    threads: Optional[int] = None
    spec_type: Optional[str] = None  # None: the run without speculation
    slots: int = 1  # -np: sequences served at once, each with ctx_size cells
    cache_ram_mib: Optional[int] = None  # --cache-ram: host memory for prompts moved out of the slots (None: its default)

    def command(self, port: int) -> list[str]:
        cmd = [self.binary, "-m", self.target, "--host", "127.0.0.1", "--port", str(port),
               "-c", str(self.ctx_size * self.slots), "-np", str(self.slots), "--no-webui"]
        if self.threads:
            cmd += ["-t", str(self.threads)]
        if self.cache_ram_mib is not None:
            cmd += ["--cache-ram", str(self.cache_ram_mib)]
        if self.spec_type is not None:
            if self.draft is not None:
                cmd += ["-md", self.draft]
            cmd += ["--spec-type", self.spec_type, "--spec-draft-n-max", str(self.num_draft_tokens)]
        return cmd


class LlamaServer:
    """One llama-server process on a free loopback port, stopped on exit."""

    def __init__(self, options: ServerOptions, log_path: Path, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.options = options
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        from specdec.server.testing import free_port  # here: specdec.server loads the whole app

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


@dataclass(frozen=True)
class PeerRun:
    """One peer configuration: its label, the method it mirrors, its K and the peer's own options
    (llama-server: the draft model and --spec-type; hf-assisted: generate's extra arguments)."""

    label: str
    method: str
    k: int
    options: dict

    def record(self, prompt: BenchPrompt, repeat: int, source: str, measured: RequestRecord, started_at: float) -> dict:
        identity = {"source": source, "prompt_id": prompt.id, "category": prompt.category, "config": self.label,
                    "method": self.method, "num_draft_tokens": self.k, "repeat": repeat, "timings": None}
        return bench_record(measured, identity, started_at)


def unrecorded(prompts: Sequence[BenchPrompt], run: PeerRun, repeats: int,
               records: RecordFile) -> list[tuple[BenchPrompt, int]]:
    """The (prompt, repeat) of `run` not yet in the record file."""
    return [(p, r) for p in prompts for r in range(repeats) if (p.id, run.label, r) not in records]


def record_failures(source: str, run: PeerRun, todo: Sequence[tuple[BenchPrompt, int]], error: str,
                    records: RecordFile, counts: dict) -> None:
    """One failed record per (prompt, repeat) of `todo`: the peer could not run `run` at all."""
    for prompt, repeat in todo:
        records.append(run.record(prompt, repeat, source, RequestRecord(error=error), time.time()))
        counts["failed"] += 1


def measure_peer(source: str, run: PeerRun, todo: Sequence[tuple[BenchPrompt, int]], settings: BenchSettings,
                 warm_up: Callable[[], object], measure: Callable[[BenchPrompt, int], RequestRecord],
                 records: RecordFile, counts: dict, unit: str, progress: bool) -> None:
    """The measurement loop of every peer configuration: `settings.warmup` unrecorded warm-ups, then
    one record per (prompt, repeat) of `todo`, appended as soon as it is measured. `measure(prompt,
    repeat)` returns what it measured; what it raises becomes the record's error."""
    from tqdm import tqdm

    for _ in range(settings.warmup):
        try:
            warm_up()
        except Exception as exc:
            log.warning("%s warm-up of %s failed: %s", source, run.label, exc)
    with tqdm(total=len(todo), unit=unit, desc=run.label, file=sys.stderr, disable=not progress,
              dynamic_ncols=True) as bar:
        for prompt, repeat in todo:
            started_at = time.time()
            try:
                measured = measure(prompt, repeat)
            except Exception as exc:
                measured = RequestRecord(error=f"{type(exc).__name__}: {exc}")
                counts["failed"] += 1
            records.append(run.record(prompt, repeat, source, measured, started_at))
            counts["measured"] += 1
            bar.update(1)


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
    settings: BenchSettings,
    records: RecordFile,
    target: str,
    draft: Optional[str],
    log_dir: Path,
    ctx_size: int = 4096,
    threads: Optional[int] = None,
    progress: bool = True,
    startup_timeout: float = STARTUP_TIMEOUT_S,
    ngram_ks: Sequence[int] = (),
) -> dict:
    """Measure llama-server without speculation, with the draft model at each of draft_ks and with
    its prompt lookup at each of ngram_ks; one record per (prompt, config, repeat)."""
    runs = [PeerRun(f"{LLAMA_SERVER}:off", "off", 0, {"draft": None, "spec_type": None})]
    if draft is not None:
        runs += [PeerRun(f"{LLAMA_SERVER}:draft:k{k}", "draft", k, {"draft": draft, "spec_type": "draft-simple"})
                 for k in draft_ks]
    runs += [PeerRun(f"{LLAMA_SERVER}:ngram:k{k}", "ngram", k, {"draft": None, "spec_type": "ngram-simple"})
             for k in ngram_ks]
    counts = {"measured": 0, "failed": 0}
    seed = None if settings.greedy else settings.seed
    for run in runs:
        todo = unrecorded(prompts, run, settings.repeats, records)
        if not todo:
            continue
        options = ServerOptions(binary, target, run.options["draft"], run.k, ctx_size, threads, run.options["spec_type"])
        log_path = Path(log_dir) / f"{run.label.replace(':', '-')}.log"
        try:
            server = LlamaServer(options, log_path, startup_timeout).start()
        except Exception as exc:
            record_failures(LLAMA_SERVER, run, todo, f"llama-server did not start: {exc}", records, counts)
            continue

        def warm_up() -> None:
            server.chat(list(prompts[0].messages), min(settings.max_tokens, WARMUP_MAX_TOKENS), settings.temperature,
                        seed)

        def measure(prompt: BenchPrompt, repeat: int) -> RequestRecord:
            started = time.perf_counter()
            response = server.chat(list(prompt.messages), settings.max_tokens, settings.temperature,
                                   None if seed is None else seed + repeat)
            wall_seconds = time.perf_counter() - started
            choice = response["choices"][0]
            timings = response.get("timings") or {}
            stats = stats_from_timings(timings)
            return RequestRecord(text=choice["message"]["content"], completion_tokens=stats["generated_tokens"],
                                 prompt_tokens=stats["prompt_tokens"], finish_reason=choice.get("finish_reason"),
                                 wall_seconds=wall_seconds, decode_tokens_per_second=stats["tokens_per_second"],
                                 stats=stats, fields={"timings": timings})

        try:
            measure_peer(LLAMA_SERVER, run, todo, settings, warm_up, measure, records, counts, "req", progress)
        finally:
            server.stop()
    return counts


class StreamClock:
    """A duck-typed transformers streamer that times generate's chunks: the first put is the
    prompt, each later one the tokens a step committed (several at once when speculating)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.chunks: list[tuple[float, int]] = []  # (time, tokens) per put

    def put(self, value) -> None:
        self.chunks.append((self.clock(), int(value.numel())))

    def end(self) -> None:
        pass


def stats_from_stream(chunks: Sequence[tuple[float, int]], started: float, ended: float, prompt_tokens: int,
                      generated: int) -> dict:
    """transformers' generation under the names the engine's stats use, timed as every stream is
    (client/records.py `stream_timing`); StreamClock's first chunk is the prompt, not generated.
    Prompt time runs to the first generated chunk (prompt processing and the first step)."""
    timing = stream_timing(chunks[1:], started, generated)
    return {
        "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "drafted_tokens": None, "accepted_tokens": None, "acceptance_rate": None,  # generate does not report them
        "prompt_seconds": ended - started if timing.ttft_seconds is None else timing.ttft_seconds,
        "total_seconds": ended - started,
        "tokens_per_second": timing.decode_tokens_per_second,
    }


def hf_runs(draft_ks: Sequence[int], ngram_ks: Sequence[int], ngram_max: int, with_draft: bool) -> list[PeerRun]:
    runs = [PeerRun(f"{HF_ASSISTED}:off", "off", 0, {})]
    if with_draft:
        runs += [PeerRun(f"{HF_ASSISTED}:draft:k{k}", "draft", k, {"num_assistant_tokens": k}) for k in draft_ks]
    runs += [PeerRun(f"{HF_ASSISTED}:ngram:k{k}", "ngram", k,
                   {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": ngram_max}) for k in ngram_ks]
    return runs


def hf_generate(target, draft, prompt_ids: Sequence[int], run: PeerRun, max_new_tokens: int, settings: BenchSettings,
                seed: Optional[int]) -> tuple[list[int], str, dict, float]:
    """One `model.generate` on a TorchBackend's model -> (token ids, finish reason, stats, wall seconds).

    Everything that would make it differ from our engine is set: greedy or plain sampling (no
    repetition penalty, top-k or top-p from the model's generation config), our end-of-generation
    ids, and the ids end at the first of them, which is not returned (as our engine does).
    """
    import torch

    options = dict(run.options)
    if "num_assistant_tokens" in options:
        # Read from the assistant's own generation config: a constant K and no early stop.
        config = draft.model.generation_config
        config.num_assistant_tokens = options.pop("num_assistant_tokens")
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        options["assistant_model"] = draft.model
    eog = sorted(target.eog_token_ids)
    # None unsets what the model's generation config would bring (Qwen's: temperature, top-k, top-p).
    sampling = {"do_sample": not settings.greedy, "temperature": None if settings.greedy else settings.temperature,
                "top_k": None, "top_p": None, "repetition_penalty": 1.0}
    if seed is not None:
        torch.manual_seed(seed)
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    stream = StreamClock()
    started = time.perf_counter()
    with torch.inference_mode():
        output = target.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                       max_new_tokens=max_new_tokens, eos_token_id=eog, pad_token_id=eog[0],
                                       streamer=stream, **sampling, **options)
    ended = time.perf_counter()
    tokens = output[0, len(prompt_ids):].tolist()
    stop = next((i for i, token in enumerate(tokens) if token in target.eog_token_ids), None)
    finish = "length" if stop is None else "stop"
    tokens = tokens if stop is None else tokens[:stop]
    return tokens, finish, stats_from_stream(stream.chunks, started, ended, len(prompt_ids), len(tokens)), ended - started


def run_hf_assisted(
    prompts: Sequence[BenchPrompt],
    draft_ks: Sequence[int],
    ngram_ks: Sequence[int],
    settings: BenchSettings,
    records: RecordFile,
    target: str,
    draft: Optional[str],
    dtype: str = "bfloat16",
    ctx_size: int = 4096,
    threads: Optional[int] = None,
    ngram_max: int = 3,
    progress: bool = True,
) -> dict:
    """Measure transformers' generate plain, assisted by the draft per K, and with prompt lookup per K."""
    from specdec.backends.torch_backend import TorchBackend

    runs = hf_runs(draft_ks, ngram_ks, ngram_max, with_draft=draft is not None)
    todo_of = {run.label: unrecorded(prompts, run, settings.repeats, records) for run in runs}
    counts = {"measured": 0, "failed": 0}
    if not any(todo_of.values()):
        return counts
    loaded = []  # the target, then the draft when a draft configuration runs
    try:
        for path in [target, *([draft] if draft is not None and draft_ks else [])]:
            loaded.append(TorchBackend(path, dtype=dtype, n_ctx=ctx_size, n_threads=threads, max_sequences=1))
    except Exception as exc:
        for backend in loaded:
            backend.close()
        for run in runs:
            record_failures(HF_ASSISTED, run, todo_of[run.label], f"loading the models failed: {exc}", records, counts)
        return counts
    target_backend, draft_backend = loaded[0], (loaded[1] if len(loaded) > 1 else None)

    def encode(prompt: BenchPrompt) -> list[int]:  # as Engine.encode_prompt(messages, chat=True)
        return target_backend.tokenize(target_backend.apply_chat_template(list(prompt.messages)), add_special=False)

    try:
        for run in runs:
            if not todo_of[run.label]:
                continue

            def warm_up() -> None:
                hf_generate(target_backend, draft_backend, encode(prompts[0]), run,
                            min(settings.max_tokens, WARMUP_MAX_TOKENS), settings, settings.seed)

            def measure(prompt: BenchPrompt, repeat: int) -> RequestRecord:
                prompt_ids = encode(prompt)
                seed = None if settings.greedy else settings.seed + repeat
                tokens, finish, stats, wall = hf_generate(target_backend, draft_backend, prompt_ids, run,
                                                          settings.max_tokens, settings, seed)
                own = {"output_token_ids": tokens}
                off = records.find((prompt.id, BASELINE, repeat))
                if settings.greedy and off is not None and off.get("success"):
                    own["matches_specdec_off"] = off["output_token_ids"] == tokens
                return RequestRecord(text=target_backend.detokenize(tokens), completion_tokens=len(tokens),
                                     prompt_tokens=len(prompt_ids), finish_reason=finish, wall_seconds=wall,
                                     ttft_seconds=stats["prompt_seconds"],
                                     decode_tokens_per_second=stats["tokens_per_second"], stats=stats, fields=own)

            measure_peer(HF_ASSISTED, run, todo_of[run.label], settings, warm_up, measure, records, counts, "gen",
                         progress)
    finally:
        for backend in loaded:
            backend.close()
    return counts
