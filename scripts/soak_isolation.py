"""Soak (issue 42): several tenants' normal and hostile traffic for ten minutes on a machine kept
busy by another process, while the server switches from PyPI's ik_llama.cpp wheel to specdec's
build. Not run in CI.

    .venv/bin/python scripts/soak_isolation.py --out soak-isolation.json            # 10 minutes
    .venv/bin/python scripts/soak_isolation.py --fake --minutes 1                    # a dry run

The server runs on PyPI's wheel (IK_LLAMA_CPP_LIB_PATH, the ik package's own override, pointing at
its unpacked library; the wheel is fetched with pip once, into ~/.cache/specdec/soak/) with a
temporary SPECDEC_HOME whose builds/ik-pending names an empty folder, as `make serve` leaves it while
specdec's build compiles. `--switch-after` seconds in, the script fills that folder with specdec's
build (links to the wheel and the unpacked library `make install` built), and the server loads it
beside the serving engine and switches to it (server/upgrade.py; the log's "serving on the new
build"). Meanwhile, with one busy-looping process per core (`--busy`, the default):

- three tenants (API keys) send greedy chat requests, streamed or not, with any speculative method,
  over fixed prompts, each client pausing up to `--think` seconds between requests;
- a fourth tenant sends scripts/hostile_server.py's attacks on repeat, every other round without
  a key;
- /health is asked every 0.2 s with a 1 s timeout, and the server's resident memory every second.

Every normal answer must be whole and equal the quiet run's text for its prompt: each prompt sent
alone, before the soak (on PyPI's wheel) and after it (on specdec's build, the machine idle again).
An answer finished before the switch must equal the first, one sent after it the second; one that
spans the switch (it waited in the queue meanwhile) either. By the rule `make serve` follows, the
wheel serves the weights as stored and the build repacked, whose greedy texts can differ
(docs/exactness.md); `--repacked` serves both repacked, where they must not.

The report (`--out`): statuses by kind of traffic and tenant, 5xx (there must be none), normal
answers lost or wrong, /health's slowest answer and failures (asked from a process of its own),
RSS at start, peak, end and once the old engine should be closed, when each step of the switch
happened, requests completed before and after it, and the libraries the server has mapped at the
end. Exit status 0 only if nothing failed and the switch came while the normal traffic ran, with
answers from both builds (the server switches between two rounds, running requests finishing
on the old engine: upgrade.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx
from hostile_server import HealthWatch, attacks, server_errors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fakes.fake_serve import rss_mib, serving  # noqa: E402
from fakes.load import LoadRequest, Outcome, client_session, send  # noqa: E402

from specdec.backends.bindings import ik_llama  # noqa: E402
from specdec.models.registry import specdec_home  # noqa: E402
from specdec.server.upgrade import LIBRARY_ENV  # noqa: E402

MODEL = "soak"
TENANTS = ("alice", "bob", "carol")
HOSTILE = "mallory"
KEYS = {name: f"sk-soak-{name}" for name in (*TENANTS, HOSTILE)}
METRICS_KEY = "sk-soak-metrics"
METHODS = ("off", "ngram", "draft", "auto")
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that returns the ten most recent rows of a table named orders.",
    "What does the yield keyword do in Python?",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
    "Give three tips for writing readable code.",
    "Write a JavaScript function that debounces another function.",
    'Convert this JSON to YAML: {"name": "specdec", "cores": 2, "tags": ["cpu", "llm"]}',
]
FAKE_COSTS = {"forward": 0.004, "row": 0.012, "prompt_row": 0.001}  # seconds: docs/server.md, Reliability
SWITCH_STEPS = {  # the server log's line for each step of the build switch (server/upgrade.py, scheduler.py)
    "build_seen": "build is ready",
    "loaded": "build loaded",
    "switched": "serving on the new build",
    "old_engine_closed": "closed the engine served before the switch",
}
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\w+) ([\w.]+): (.*)$")


# -- the build switch ----------------------------------------------------------------------------
def specdec_build(explicit: Optional[Path]) -> Path:
    """The folder of specdec's ik build (its wheel and `unpacked/`): the one installed in this
    virtualenv (lib/specdec-build names it), else the newest under ~/.cache/specdec/wheels."""
    def complete(folder: Path) -> bool:
        return any(folder.glob("ik_llama_cpp_python-*.whl")) and (folder / "unpacked" / "ik_llama_cpp" / "lib"
                                                                   / "libllama.so").exists()
    if explicit is not None:
        if not complete(explicit):
            sys.exit(f"{explicit} holds no complete ik build (a wheel and unpacked/ik_llama_cpp/lib/libllama.so)")
        return explicit
    library = ik_llama.library_path()
    marker = library.parent / "specdec-build" if library else None
    if marker is not None and marker.exists():
        folder = specdec_home() / "wheels" / marker.read_text().strip()
        if complete(folder):
            return folder
    built = sorted((f for f in (specdec_home() / "wheels").glob("ik-llama-cpp-python-*") if complete(f)),
                   key=lambda f: f.stat().st_mtime)
    if not built:
        sys.exit("specdec's ik_llama.cpp build is not there: run `make install-test` (or give --build)")
    return built[-1]


def pypi_library() -> Path:
    """PyPI's ik wheel's libllama.so, unpacked under ~/.cache/specdec/soak/ (downloaded once with
    pip, as scripts/install.sh installs it)."""
    folder = specdec_home() / "soak" / f"pypi-ik-llama-cpp-python-{ik_llama.VERSION}"
    library = folder / "unpacked" / "ik_llama_cpp" / "lib" / "libllama.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(folder), f"{ik_llama.PACKAGE}=={ik_llama.VERSION}"], check=True)
        wheel = next(folder.glob("ik_llama_cpp_python-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(folder / "unpacked")
        for path in (folder / "unpacked").rglob("*.so*"):
            path.chmod(0o755)
    if any(ik_llama.ONE_ROW_EXACT_SYMBOL.encode() in path.read_bytes() for path in (folder / "unpacked").rglob("*.so*")):
        sys.exit(f"{folder} holds specdec's build, not PyPI's wheel: the server would not switch")
    return library


class Switch:
    """A SPECDEC_HOME (temporary) as `make serve` leaves it while the build compiles: the models of
    the real one, and builds/ik-pending naming an empty folder; `arm()` puts the build there."""

    def __init__(self, build: Path, root: Path):
        self.build, self.home = build, root / "home"
        self.pending = root / "pending-build"
        self.pending.mkdir(parents=True)
        (self.home / "builds").mkdir(parents=True)
        (self.home / "models").symlink_to(specdec_home() / "models", target_is_directory=True)
        (self.home / "builds" / "ik-pending").write_text(f"{self.pending}\n")
        self.armed_at: Optional[float] = None

    def arm(self) -> None:
        """As scripts/build_ik.sh finishes: the unpacked library first, the wheel last."""
        (self.pending / "unpacked").symlink_to(self.build / "unpacked", target_is_directory=True)
        for wheel in self.build.glob("ik_llama_cpp_python-*.whl"):
            (self.pending / wheel.name).symlink_to(wheel)
        self.armed_at = time.time()


def log_events(log: Path) -> tuple[dict[str, float], list[str]]:
    """The switch's steps (time.time() of the first line of each) and the ERROR lines, from the log."""
    steps: dict[str, float] = {}
    errors = []
    for line in log.read_text(errors="replace").splitlines():
        match = LOG_LINE.match(line)
        if match is None:
            continue
        stamp, millis, level, _, message = match.groups()
        when = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        for step, text in SWITCH_STEPS.items():
            if text in message and step not in steps:
                steps[step] = when
        if level in ("ERROR", "CRITICAL"):
            errors.append(line)
    return steps, errors


def mapped_libraries(pid: int) -> list[str]:
    """The ik/ggml libraries the server process has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if re.search(r"lib(llama|ggml)[^/]*\.so", line)})


# -- the machine kept busy, memory, traffic ----------------------------------------------------------
@contextmanager
def cpu_burner(processes: int) -> Iterator[None]:
    """`processes` busy loops at normal priority, stopped at the end."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def _watch_health(url: str, stop, results) -> None:
    watch = HealthWatch(url)
    watch.start()
    stop.wait()
    watch.stop.set()
    watch.join()
    results.put({"checks": watch.checks, "failures": watch.failures, "slowest": watch.slowest,
                 "failed_at": watch.failed_at})


@contextmanager
def health_watch(url: str) -> Iterator[dict]:
    """hostile_server's HealthWatch in a process of its own (this one's threads, sending the hostile
    bodies, must not delay it); its figures in the dict yielded, once the block is over."""
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    process = context.Process(target=_watch_health, args=(url, stop, results), daemon=True)
    process.start()
    figures: dict = {}
    try:
        yield figures
    finally:
        stop.set()
        figures.update(results.get(timeout=60))
        process.join()


class RssWatch(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples = pid, []  # (time.time(), MiB)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.samples.append((time.time(), rss_mib(self.pid)["rss"]))


@dataclass
class Answer:
    tenant: str
    prompt: int
    sent_at: float  # time.time()
    done_at: float
    outcome: Outcome


async def tenant_client(url: str, tenant: str, index: int, args, deadline: float, answers: list[Answer]) -> None:
    rng = random.Random(f"{tenant}-{index}")
    async with client_session() as http:
        while time.monotonic() < deadline:
            prompt = rng.randrange(len(PROMPTS))
            request = LoadRequest(PROMPTS[prompt], args.max_tokens, rng.choice(METHODS), api_key=KEYS[tenant],
                                  stream=rng.random() < 0.5)
            sent_at = time.time()
            outcome = await send(http, url, MODEL, request)
            answers.append(Answer(tenant, prompt, sent_at, time.time(), outcome))
            await asyncio.sleep(outcome.retry_after + rng.uniform(0, args.think))


def hostile_rounds(url: str, port: int, args, deadline: float, rounds: list[dict]) -> None:
    """The hostile attacks until the deadline, with the hostile tenant's key and without a key in turn."""
    while time.monotonic() < deadline:
        key = KEYS[HOSTILE] if len(rounds) % 2 == 0 else None
        spans: dict = {}
        try:
            results = attacks(url, port, args.write_timeout, MODEL, key, spans)
        except Exception as exc:  # a transport error mid-round (the server gone?): recorded, not raised
            results = {"round failed": f"{type(exc).__name__}: {exc}"}
        rounds.append({"tenant": HOSTILE if key else "unauthenticated", "results": results, "spans": spans})


async def quiet_run(url: str, max_tokens: int) -> list[str]:
    """Each prompt alone, plain greedy decoding: the reference texts."""
    texts = []
    async with client_session() as http:
        for prompt in PROMPTS:
            outcome = await send(http, url, MODEL, LoadRequest(prompt, max_tokens, "off", api_key=KEYS[TENANTS[0]],
                                                               stream=False))
            if outcome.status != 200 or outcome.problem:
                sys.exit(f"the quiet run failed: {outcome.status} {outcome.problem}")
            texts.append(outcome.text)
    return texts


async def soak(url: str, port: int, args, switch: Optional[Switch]) -> tuple[list[Answer], list[dict]]:
    deadline = time.monotonic() + args.minutes * 60
    answers: list[Answer] = []
    rounds: list[dict] = []

    async def arm() -> None:
        await asyncio.sleep(args.switch_after)
        if switch is not None:
            switch.arm()
            print(f"specdec's build put in the pending folder at {args.switch_after:g} s", flush=True)

    async def progress() -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(60)
            print(f"{(time.monotonic() - started) / 60:.0f} min: {len(answers)} normal requests "
                  f"({sum(1 for a in answers if a.outcome.status == 200)} answered 200), "
                  f"{len(rounds)} hostile rounds", flush=True)

    side_tasks = [asyncio.create_task(arm()), asyncio.create_task(progress())]
    await asyncio.gather(asyncio.to_thread(hostile_rounds, url, port, args, deadline, rounds),
                         *(tenant_client(url, tenant, i, args, deadline, answers)
                           for tenant in TENANTS for i in range(args.clients_per_tenant)))
    for task in side_tasks:
        task.cancel()
    return answers, rounds


def server_statuses(url: str) -> dict:
    """The server's own count of answers, by route and status."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=30).text
    counts: dict = {}
    for line in text.splitlines():
        if line.startswith("specdec:http_requests_total{"):
            route = line.split('route="')[1].split('"')[0]
            status = line.split('status="')[1].split('"')[0]
            counts.setdefault(route, {})[status] = int(float(line.rsplit(" ", 1)[1]))
    return counts


# -- judging ---------------------------------------------------------------------------------------
def judge_normal(answers: list[Answer], before: list[str], after: list[str], switched_at: Optional[float]) -> dict:
    """Statuses by tenant; each answer's text against the reference of the build that served it."""
    by_tenant = {tenant: Counter() for tenant in TENANTS}
    sides: Counter = Counter()
    problems = []
    for answer in answers:
        outcome = answer.outcome
        by_tenant[answer.tenant][str(outcome.status)] += 1
        if outcome.status != 200 or outcome.problem:
            if outcome.status != 429 or outcome.problem:
                problems.append(f"{answer.tenant}, prompt {answer.prompt}: {outcome.status} {outcome.problem}")
            continue
        if switched_at is None or answer.done_at < switched_at:
            side, allowed = "before the switch", {before[answer.prompt]}
        elif answer.sent_at > switched_at:
            side, allowed = "after the switch", {after[answer.prompt]}
        else:
            side, allowed = "spanning the switch", {before[answer.prompt], after[answer.prompt]}
        sides[side] += 1
        if outcome.text not in allowed:
            sides["wrong"] += 1
            problems.append(f"{answer.tenant}, prompt {answer.prompt}, {side}, method {outcome.request.method}, "
                            f"stream {outcome.request.stream}: {outcome.text!r} not {sorted(allowed)!r}")
    latencies = sorted(a.outcome.latency for a in answers if a.outcome.status == 200 and not a.outcome.problem)
    return {
        "requests": len(answers),
        "statuses_by_tenant": {tenant: dict(counts) for tenant, counts in by_tenant.items()},
        "server_errors_5xx": sum(1 for a in answers if a.outcome.status is not None and a.outcome.status >= 500),
        "lost": sum(1 for a in answers if a.outcome.status is None
                    or (a.outcome.status == 200 and a.outcome.problem is not None)),
        "refused_other_than_429": sum(1 for a in answers if a.outcome.status is not None
                                      and a.outcome.status not in (200, 429) and a.outcome.status < 500),
        "wrong": sides.pop("wrong", 0),
        "completed": dict(sides),
        "completion_tokens": sum(a.outcome.completion_tokens for a in answers if a.outcome.status == 200),
        "latency_p50_s": round(latencies[len(latencies) // 2], 2) if latencies else None,
        "latency_max_s": round(latencies[-1], 2) if latencies else None,
        "problems": problems[:10],
    }


def judge_hostile(rounds: list[dict]) -> dict:
    """By sender and attack, how often each answer came; when the stalled readers' connections closed."""
    counts: dict = {}
    closed_after: list[float] = []
    for entry in rounds:
        sender = counts.setdefault(entry["tenant"], {"rounds": 0})
        sender["rounds"] += 1
        for attack, value in entry["results"].items():
            tally = sender.setdefault(attack, Counter())
            if isinstance(value, dict):
                tally.update(value)
            elif value.startswith("closed "):
                tally["closed"] += 1
                closed_after.append(float(value.split()[1]))
            else:
                tally[value] += 1
    report = {sender: {attack: dict(value) if isinstance(value, Counter) else value for attack, value in by_attack.items()}
              for sender, by_attack in counts.items()}
    return {"by_sender": report, "server_errors": sorted({f"{entry['tenant']}: {attack}" for entry in rounds
                                                          for attack in server_errors(entry["results"])}),
            "rounds_failed": [entry["results"]["round failed"] for entry in rounds if "round failed" in entry["results"]],
            "stalled_reader_closed_after_s": [min(closed_after), max(closed_after)] if closed_after else None}


def attacks_at(rounds: list[dict], when: float) -> list[str]:
    """The hostile attacks running at `when` (time.time()), or within the 1 s before it (the
    health check that failed began then)."""
    return [name for entry in rounds for name, (start, end) in entry.get("spans", {}).items()
            if start <= when and end >= when - 1.0]


@dataclass
class Measured:
    """What one run saw, before it is judged."""

    log: Path
    before: list[str]  # the quiet run's texts, by prompt, before the soak
    after: list[str]  # and after it
    quiet_seconds: float
    soak_started: float  # time.time()
    soak_ended: float
    answers: list[Answer]
    rounds: list[dict]
    health: dict  # health_watch's figures
    rss_samples: list[tuple[float, float]]
    rss: dict[str, float]  # MiB: start, end (of the soak), after (the quiet run after it), peak
    statuses: dict
    libraries: list[str]
    armed_at: Optional[float]


def measure(args) -> Measured:
    """Starts the server, runs the quiet run, the soak and the quiet run again; stops the server."""
    flags = ["--served-model-name", MODEL, "--parallel", str(args.slots), "--max-queue", "16", "--log-level", "info",
             "--write-timeout", str(args.write_timeout), "--header-timeout", "10"]
    env = {"SPECDEC_API_KEYS": json.dumps(KEYS), "SPECDEC_METRICS_KEY": METRICS_KEY}
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specdec-soak-")))
        switch = None
        if not args.fake:
            switch = Switch(specdec_build(args.build), root)
            env.update({"SPECDEC_HOME": str(switch.home), LIBRARY_ENV: str(pypi_library())})
            flags += ["--repacked"] if args.repacked else []
        log_path = args.out.with_suffix(".log") if args.out else root / "server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = stack.enter_context(open(log_path, "w+b"))
        started = time.time()
        if args.fake:
            context = serving(["--model", "fake.gguf", *flags], FAKE_COSTS, env=env, log=log)
        else:
            context = serving(flags, command=[sys.executable, "-m", "specdec.cli"], start_timeout=900, env=env, log=log)
        url, process = stack.enter_context(context)
        print(f"server healthy after {time.time() - started:.0f} s; log: {log_path}", flush=True)
        quiet = time.monotonic()
        before = asyncio.run(quiet_run(url, args.max_tokens))
        quiet_seconds = time.monotonic() - quiet

        rss = {"start": rss_mib(process.pid)["rss"]}
        rss_watch = RssWatch(process.pid)
        rss_watch.start()
        soak_started = time.time()
        with health_watch(url) as health, cpu_burner((os.cpu_count() or 1) if args.busy else 0):
            answers, rounds = asyncio.run(soak(url, int(url.rsplit(":", 1)[1]), args, switch))
        soak_ended = time.time()
        rss_watch.stop.set()
        rss_watch.join()
        rss["end"] = rss_mib(process.pid)["rss"]

        wait_until = time.monotonic() + args.switch_wait
        while switch is not None and "switched" not in log_events(log_path)[0] and time.monotonic() < wait_until:
            time.sleep(1.0)
        after = asyncio.run(quiet_run(url, args.max_tokens))
        now = rss_mib(process.pid)
        rss["after"] = now["rss"]
        rss["peak"] = max([now["peak"], *(mib for _, mib in rss_watch.samples)])
        return Measured(log_path, before, after, quiet_seconds, soak_started, soak_ended, answers, rounds, health,
                        rss_watch.samples, rss, server_statuses(url), mapped_libraries(process.pid),
                        switch.armed_at if switch else None)


def build_report(args, run: Measured) -> dict:
    def since_start(when: Optional[float]) -> Optional[float]:
        return None if when is None else round(when - run.soak_started, 1)

    steps, errors = log_events(run.log)
    switched_at = steps.get("switched")
    in_soak = switched_at is not None and switched_at <= run.soak_started + args.minutes * 60  # normal traffic on
    report = {
        "server": "fake models (no switch)" if args.fake else "the default pair, PyPI's ik wheel then specdec's build",
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "soak_seconds": round(run.soak_ended - run.soak_started, 1),
        "switch": {
            "build_put_in_place_s": since_start(run.armed_at),
            **{f"{step}_s": since_start(steps.get(step)) for step in SWITCH_STEPS},
            "while_normal_traffic_ran": in_soak,
            "libraries_mapped_at_the_end": run.libraries,
        },
        "references": {"prompts": len(PROMPTS), "quiet_run_s": round(run.quiet_seconds, 1),
                       "differ_between_builds": sum(1 for a, b in zip(run.before, run.after) if a != b)},
        "normal": judge_normal(run.answers, run.before, run.after, switched_at),
        "hostile": judge_hostile(run.rounds),
        "health": {"checks": run.health["checks"], "failures": run.health["failures"],
                   "slowest_s": round(run.health["slowest"], 3),
                   "failed_at_s": [since_start(when) for when in run.health["failed_at"]][:20],
                   "attacks_then": [attacks_at(run.rounds, when) for when in run.health["failed_at"]][:20]},
        "rss_mib": {**{key: round(value, 1) for key, value in run.rss.items()},
                    "by_minute": [round(mib, 1) for _, mib in run.rss_samples[::60]]},
        "server_counted_5xx": {route: n for route, counts in run.statuses.items()
                               for status, n in counts.items() if status.startswith("5")},
        "server_counted": run.statuses,
        "server_log": {"path": str(run.log), "errors": len(errors), "first_errors": errors[:5]},
    }
    report["failures"] = failures(args, report)
    report["passed"] = not report["failures"]
    return report


def failures(args, report: dict) -> list[str]:
    normal, hostile = report["normal"], report["hostile"]
    checks = (
        ("5xx to normal traffic", normal["server_errors_5xx"]), ("5xx to hostile traffic", hostile["server_errors"]),
        ("5xx counted by the server", report["server_counted_5xx"]), ("normal answers lost", normal["lost"]),
        ("normal answers wrong", normal["wrong"]), ("normal answers refused", normal["refused_other_than_429"]),
        ("hostile rounds failed", hostile["rounds_failed"]), ("/health failed", report["health"]["failures"]),
        ("no switch while normal traffic ran", not args.fake and not report["switch"]["while_normal_traffic_ran"]),
        ("no normal answer from the new build", not args.fake and not normal["completed"].get("after the switch")),
        ("the quiet runs before and after differ", (args.fake or args.repacked)
         and report["references"]["differ_between_builds"]),
    )
    return [name for name, failed in checks if failed]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--busy", action=argparse.BooleanOptionalAction, default=True,
                        help="one busy-looping process per core during the soak (default: on)")
    parser.add_argument("--slots", type=int, default=4, help="the server's --parallel")
    parser.add_argument("--clients-per-tenant", type=int, default=2)
    parser.add_argument("--think", type=float, default=2.0, help="a normal client's pause between requests, at most (s)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--switch-after", type=float, default=90.0, help="seconds into the soak the build appears")
    parser.add_argument("--switch-wait", type=float, default=300.0,
                        help="seconds to wait after the traffic for a switch not yet made (then: idle)")
    parser.add_argument("--repacked", action="store_true",
                        help="serve both builds' target repacked: one reference across the switch")
    parser.add_argument("--write-timeout", type=float, default=5.0)
    parser.add_argument("--build", type=Path, help="specdec's ik build folder (default: the installed one)")
    parser.add_argument("--fake", action="store_true", help="the fake models, no switch (a dry run of the script)")
    parser.add_argument("--out", type=Path, help="the JSON report; the server's log beside it (.log)")
    args = parser.parse_args()

    report = build_report(args, measure(args))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({key: report[key] for key in ("soak_seconds", "switch", "references", "health", "rss_mib",
                                                    "server_counted_5xx")}, indent=1))
    normal = report["normal"]
    print(json.dumps({key: value for key, value in normal.items() if key != "problems"}, indent=1))
    for problem in normal["problems"]:
        print("  ", problem)
    print("PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failures"]))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
