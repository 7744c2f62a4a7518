"""Run two real agent CLIs, OpenAI's Codex CLI and Anthropic's Claude Code, against `specdec serve`.

Each CLI gets one small task that needs a tool round trip (run a command that writes a file and
prints it, then report its output) in a throwaway folder, talking only to the local server: Codex over the Responses API
(`POST /v1/responses`), Claude Code over the Messages API (`POST /v1/messages`). Then the script
checks the outcome (the CLI exited 0, hello.txt holds the word, the command ran, the answer
reports its output) and prints, per CLI, pass or fail,
the model turns (HTTP requests, from the server's /metrics), the wall time and the time per turn.

    .venv/bin/python scripts/agent_clis.py                       # a server already on :8000
    .venv/bin/python scripts/agent_clis.py --serve --cli codex   # start `specdec serve` itself
    .venv/bin/python scripts/agent_clis.py --url http://127.0.0.1:8931 --cli claude --lean

The CLIs are npm packages, installed at the pinned versions below into
~/.cache/specdec/agent-clis (node and npm needed). Nothing they do may reach past this machine:
each runs in a network namespace of its own that has only loopback, joined to the server by a
relay (below), with every update check, telemetry and web tool switched off as well. Stdlib only.
Exits 1 when a CLI failed, 2 when the set-up failed.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIX = Path.home() / ".cache" / "specdec" / "agent-clis"
RUNS = Path.home() / ".cache" / "specdec" / "agent-runs"  # not /tmp: Codex refuses helper binaries there
PINS = {"codex": ("@openai/codex", "0.171.0"), "claude": ("@anthropic-ai/claude-code", "2.1.332")}
API_PATH = {"codex": "/v1/responses", "claude": "/v1/messages"}
# One command that writes the file and prints it, then a report of its output: a full tool round
# trip that a 1.5B model can follow (asked for two calls, it stopped after the first).
TASK = ("Run this shell command in the working directory: `echo specdec > hello.txt && cat hello.txt`. "
        "Then reply with exactly what it printed.")
EXPECTED = "specdec"
LEAN_INSTRUCTIONS = ("You are a coding agent in a terminal. Use the exec_command tool to run shell "
                     "commands in the working directory. When the task is done, reply with a short summary.\n")


def die(message: str) -> None:
    """A set-up failure (no npm, no server, no namespace): exit 2, apart from a CLI's failure."""
    print("agent_clis: " + message, file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------- installing the CLIs

def cli_path(name: str) -> Path:
    return PREFIX / "node_modules" / ".bin" / name


def installed_version(name: str) -> str | None:
    manifest = PREFIX / "node_modules" / PINS[name][0] / "package.json"
    try:
        return json.loads(manifest.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def install_clis(names: list[str]) -> None:
    """npm-installs the pinned versions into PREFIX unless they are there already. Both packages
    bring their native binary as an optional dependency for this platform; Claude Code's
    postinstall copies it over its bin/ placeholder."""
    missing = [n for n in names if installed_version(n) != PINS[n][1] or not cli_path(n).exists()]
    if not missing:
        return
    if not shutil.which("npm"):
        die("npm is needed to install " + ", ".join(missing))
    PREFIX.mkdir(parents=True, exist_ok=True)
    specs = [f"{PINS[n][0]}@{PINS[n][1]}" for n in missing]
    print(f"installing {' '.join(specs)} into {PREFIX}", flush=True)
    subprocess.run(["npm", "install", "--prefix", str(PREFIX), "--save-exact", "--no-audit", "--no-fund",
                    "--loglevel", "error", *specs], check=True)


# ---------------------------------------------------------------- the server

def http_get(url: str, api_key: str | None, timeout: float = 30) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def check_loopback(url: str) -> tuple[str, int]:
    """The CLIs may talk to this machine only: refuse any other host."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if host != "localhost" and not host.startswith("127."):
        die(f"{url} is not a loopback address")
    return host, parts.port or 80


def start_server(port: int, timeout: float, log_path: Path) -> subprocess.Popen:
    """Starts `specdec serve` with room for an agent's prompt: the first request was 4,749 tokens
    (Codex) and 3,945 (Claude Code, its tools cut to four), and each turn adds to it; the default
    slot has 4,096."""
    specdec = REPO / ".venv" / "bin" / "specdec"
    if not specdec.exists():
        die(f"{specdec} is missing (make serve installs it)")
    command = [str(specdec), "serve", "--host", "127.0.0.1", "--port", str(port), "--parallel", "1",
               "--ctx-size", "32768", "--request-timeout", str(max(600, int(timeout)))]
    print("starting", " ".join(command), f"(log: {log_path})", flush=True)
    log = open(log_path, "wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, server: subprocess.Popen | None, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            die(f"specdec serve exited with {server.returncode} before it was healthy")
        try:
            if http_get(url + "/health", None, timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    die(f"{url}/health not ok after {limit:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and nothing else
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def served_model(url: str, api_key: str | None) -> str:
    status, body = http_get(url + "/v1/models", api_key)
    if status != 200:
        die(f"GET /v1/models answered {status}: {body[:200]}")
    return json.loads(body)["data"][0]["id"]


def warn_small_context(url: str, api_key: str | None) -> None:
    """/props (llama-server's) names the context per slot: an agent's first prompt is 4-5k tokens."""
    try:
        status, body = http_get(url + "/props", api_key)
        n_ctx = json.loads(body)["default_generation_settings"]["n_ctx"] if status == 200 else None
    except (OSError, ValueError, KeyError, TypeError):
        n_ctx = None
    if n_ctx is not None and n_ctx < 16384:
        print(f"warning: the server's context is {n_ctx} tokens per slot; the CLIs' prompts are 4-5k "
              "tokens to start and grow each turn (specdec serve --ctx-size 32768)", file=sys.stderr)


def metrics(url: str, api_key: str | None) -> dict[str, float] | None:
    """The counters that tell what a CLI cost the server: requests per route, finished
    generations, prompt / cached / generated tokens (Prometheus text, summed over labels
    except `route`)."""
    try:
        status, text = http_get(url + "/metrics", api_key)
    except OSError:
        return None
    if status != 200:
        return None
    wanted = ("specdec:http_requests_total", "specdec:request_success_total", "specdec:prompt_tokens_total",
              "specdec:prefix_cache_hit_tokens_total", "specdec:generation_tokens_total")
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in wanted:
            continue
        key = name
        if name == "specdec:http_requests_total":
            key += ":" + line.split('route="', 1)[1].split('"', 1)[0]
        totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def turns_from_metrics(before: dict | None, after: dict | None, cli: str) -> dict | None:
    if before is None or after is None:
        return None
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # A route the metrics do not name is counted as "other"; nothing else hits the server meanwhile.
    route = "specdec:http_requests_total:" + API_PATH[cli]
    requests = delta.get(route) or delta.get("specdec:http_requests_total:other", 0.0)
    return {"requests": int(requests), "generations": int(delta.get("specdec:request_success_total", 0)),
            "prompt_tokens": int(delta.get("specdec:prompt_tokens_total", 0)),
            "cached_tokens": int(delta.get("specdec:prefix_cache_hit_tokens_total", 0)),
            "generated_tokens": int(delta.get("specdec:generation_tokens_total", 0))}


# ---------------------------------------------------------------- isolation: a loopback-only namespace

def pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def relay(listener: socket.socket, connect) -> None:
    """Accepts connections forever, joining each to a new connection made by `connect()`."""
    while True:
        client, _ = listener.accept()
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


def serve_unix_relay(sock_path: Path, host: str, port: int) -> None:
    """Outside the namespace: a Unix socket (files cross network namespaces) that leads to the server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(64)
    threading.Thread(target=relay, args=(listener, lambda: socket.create_connection((host, port))),
                     daemon=True).start()


def loopback_up() -> None:
    """A new network namespace starts with `lo` down: set IFF_UP (SIOCGIFFLAGS / SIOCSIFFLAGS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1))


def inside_namespace(sock_path: str, port: int, command: list[str]) -> int:
    """Inside the namespace: listen on 127.0.0.1:port as the server would, relay to the Unix
    socket, run the CLI. The CLI sees the same URL and Host header; any other address is unreachable."""
    loopback_up()
    listener = socket.create_server(("127.0.0.1", port))

    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        return s

    threading.Thread(target=relay, args=(listener, connect), daemon=True).start()
    return subprocess.call(command)


def can_isolate() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.call(["unshare", "--net", "true"], stderr=subprocess.DEVNULL) == 0


# ---------------------------------------------------------------- the two CLIs

def common_env(home: Path) -> dict[str, str]:
    """A throwaway HOME (no login, no user config, no shell profile of yours), the same PATH."""
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "TERM": "dumb", "NO_COLOR": "1"}
    # Where a namespace can't be had, anything that honours a proxy dies on a dead local port.
    env.update({"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
                "ALL_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"})
    return env


def codex_command(base_url: str, model: str, home: Path, work: Path, api_key: str, timeout: float,
                  lean: bool) -> tuple[list[str], dict[str, str]]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    extra = ""
    if lean:  # a 150-character system prompt instead of Codex's ~17k characters
        (home / "instructions.md").write_text(LEAN_INSTRUCTIONS)
        extra = f'model_instructions_file = "{home / "instructions.md"}"\ninclude_permissions_instructions = false\n'
    idle_ms = int(timeout * 1000)  # the prefill of a ~5k-token prompt on 2 cores sends nothing for minutes
    (codex_home / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "specdec"
model_context_window = 32768
model_reasoning_summary = "none"
approval_policy = "never"
sandbox_mode = "workspace-write"
check_for_update_on_startup = false
web_search = "disabled"
{extra}
[model_providers.specdec]
name = "specdec"
base_url = "{base_url}/v1"
env_key = "SPECDEC_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {idle_ms}

# Only the shell tools: no subagents, goals, plugins, apps, images, browser, skills.
[features]
goals = false
plugins = false
apps = false
remote_plugin = false
image_generation = false
view_image = false
browser_use = false
computer_use = false
tool_suggest = false
memories = false
hooks = false
shell_snapshot = false
enable_request_compression = false
unbounded_connection_retries = false

[agents]
enabled = false

[skills]
include_instructions = false

[tools.experimental_request_user_input]
enabled = false

[history]
persistence = "none"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
""")
    env = common_env(home) | {"CODEX_HOME": str(codex_home), "SPECDEC_API_KEY": api_key}
    command = [str(cli_path("codex")), "exec", "--skip-git-repo-check", "--strict-config", "--ephemeral",
               "--json", "--color", "never", "-C", str(work), TASK]
    return command, env


def claude_command(base_url: str, model: str, home: Path, work: Path, api_key: str, timeout: float,
                   lean: bool) -> tuple[list[str], dict[str, str]]:
    env = common_env(home) | {
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": api_key,
        # every model alias, including the small one for side tasks, is the served model
        "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        "API_TIMEOUT_MS": str(int(timeout * 1000)), "CLAUDE_CODE_MAX_RETRIES": "0",
        # no thinking / context-management / tool-search extras a local model can't honour
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1", "ENABLE_TOOL_SEARCH": "false", "MAX_THINKING_TOKENS": "0",
        # its default max_tokens is 32,000: prompt + that would not fit a 32k context
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096", "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "32768",
    }
    tools = "Bash,Write,Read,Edit"
    command = [str(cli_path("claude")), "-p", TASK, "--model", model, "--output-format", "stream-json",
               "--verbose", "--tools", tools, "--allowedTools", tools, "--permission-mode", "acceptEdits",
               "--no-session-persistence"]
    if lean:  # no system prompt beyond a line, no CLAUDE.md, hooks or plugins
        command.append("--bare")
    return command, env


def read_codex_events(stdout: str) -> dict:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    commands = [i.get("command", "") for i in items if i.get("type") == "command_execution"]
    messages = [i.get("text", "") for i in items if i.get("type") == "agent_message"]
    errors = [e.get("message") or e.get("error", {}).get("message") for e in events
              if e.get("type") in ("error", "turn.failed")]
    return {"ok": any(e.get("type") == "turn.completed" for e in events), "commands": commands,
            "answer": messages[-1] if messages else "", "errors": errors,
            # one model request per batch of tool calls, plus the last answer
            "cli_turns": len([i for i in items if i.get("type") in ("command_execution", "file_change")]) + 1}


def read_claude_events(stdout: str) -> dict:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    result = next((e for e in reversed(events) if e.get("type") == "result"), {})
    commands = [block.get("input", {}).get("command", block.get("name", ""))
                for e in events if e.get("type") == "assistant"
                for block in e.get("message", {}).get("content", []) if block.get("type") == "tool_use"]
    return {"ok": bool(result) and not result.get("is_error"), "commands": commands,
            "answer": result.get("result", ""), "cli_turns": result.get("num_turns"),
            "errors": [result.get("result")] if result.get("is_error") else []}


# ---------------------------------------------------------------- one run

def run_cli(cli: str, url: str, model: str, api_key: str, timeout: float, lean: bool, isolate: bool) -> dict:
    RUNS.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"{cli}-", dir=RUNS))
    home, work = root / "home", root / "work"
    home.mkdir()
    work.mkdir()
    build = codex_command if cli == "codex" else claude_command
    command, env = build(url, model, home, work, api_key, timeout, lean)
    if isolate:
        host, port = check_loopback(url)
        sock = root / "relay.sock"
        serve_unix_relay(sock, host, port)
        command = ["unshare", "--net", "--", sys.executable, str(Path(__file__).resolve()), "_inside",
                   str(sock), str(port), "--", *command]
    before = metrics(url, api_key)
    started = time.monotonic()
    with open(root / "stdout.jsonl", "w") as out, open(root / "stderr.txt", "w") as err:
        process = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=err, start_new_session=True)
        try:
            rc = process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the CLI's own process group, nothing else
            process.wait()
            rc = None
    wall = time.monotonic() - started
    after = metrics(url, api_key)
    seen = (read_codex_events if cli == "codex" else read_claude_events)((root / "stdout.jsonl").read_text())
    hello = work / "hello.txt"
    content = hello.read_text(errors="replace") if hello.exists() else None
    failures = []
    if rc != 0:
        failures.append("timed out" if rc is None else f"exit status {rc}")
    if not seen["ok"]:
        failures.append("no successful end in its JSON output")
    if content is None:
        failures.append("hello.txt missing")
    elif content.strip() != EXPECTED:
        failures.append(f"hello.txt holds {content[:40]!r}")
    if not any("cat" in c for c in seen["commands"]):
        failures.append("never ran `cat hello.txt`")
    if EXPECTED not in seen["answer"]:
        failures.append("its answer does not report the output")
    server = turns_from_metrics(before, after, cli)
    turns = server["requests"] if server else seen["cli_turns"]
    return {"cli": cli, "version": PINS[cli][1], "passed": not failures, "failures": failures,
            "rc": rc, "wall_s": round(wall, 1), "turns": turns,
            "s_per_turn": round(wall / turns, 1) if turns else None, "server": server,
            "cli_turns": seen["cli_turns"], "commands": seen["commands"], "answer": seen["answer"][:200],
            "errors": list(dict.fromkeys(e for e in seen["errors"] if e))[:3], "folder": str(root)}


def report(result: dict) -> None:
    verdict = "PASS" if result["passed"] else "FAIL: " + "; ".join(result["failures"])
    print(f"\n{result['cli']} {result['version']}: {verdict}")
    print(f"  turns {result['turns']} (the CLI counts {result['cli_turns']}), wall {result['wall_s']} s, "
          f"{result['s_per_turn']} s per turn")
    if result["server"]:
        s = result["server"]
        print(f"  server: {s['generations']} generations, {s['prompt_tokens']} prompt tokens "
              f"({s['cached_tokens']} from the prefix cache), {s['generated_tokens']} generated")
    for c in result["commands"]:
        print(f"  ran: {c[:120]}")
    if result["answer"]:
        print(f"  answer: {result['answer']!r}")
    for e in result["errors"]:
        print(f"  error: {str(e)[:300]}")
    print(f"  logs: {result['folder']}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_inside":  # re-run inside the namespace (see run_cli)
        sock, port, _, *command = sys.argv[2:]
        return inside_namespace(sock, int(port), command)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8000", help="a running specdec server (loopback)")
    where.add_argument("--serve", action="store_true", help="start .venv/bin/specdec serve and stop it after")
    parser.add_argument("--port", type=int, default=8931, help="the port for --serve")
    parser.add_argument("--cli", choices=["codex", "claude", "both"], default="both")
    parser.add_argument("--model", help="the model name to send (default: GET /v1/models' first id)")
    parser.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY", ""),
                        help="the server's key, if it has one")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per CLI run")
    parser.add_argument("--lean", action="store_true", help="minimal system prompts (fast prefill, less realistic)")
    parser.add_argument("--no-isolate", action="store_true", help="don't run the CLIs in a loopback-only namespace")
    parser.add_argument("--keep", action="store_true", help="keep the run folders of passing CLIs too")
    args = parser.parse_args()

    names = ["codex", "claude"] if args.cli == "both" else [args.cli]
    isolate = not args.no_isolate and can_isolate()
    if not isolate:
        why = "--no-isolate" if args.no_isolate else "no network namespace (needs root and unshare)"
        print(f"warning: {why}: the CLIs run unconfined, with telemetry and updates off and proxies "
              "pointed at a dead local port", file=sys.stderr)
    install_clis(names)
    # 127.0.0.1, not localhost: inside the namespace only the IPv4 loopback has the relay
    url = f"http://127.0.0.1:{args.port}" if args.serve else args.url.rstrip("/").replace("//localhost", "//127.0.0.1")
    check_loopback(url)
    server = None
    try:
        if args.serve:
            RUNS.mkdir(parents=True, exist_ok=True)
            server = start_server(args.port, args.timeout, RUNS / "serve.log")
        wait_healthy(url, server, 1800 if server else 10)
        model = args.model or served_model(url, args.api_key or None)
        warn_small_context(url, args.api_key or None)
        print(f"server {url}, model {model}, {'isolated' if isolate else 'NOT isolated'}", flush=True)
        results = []
        for name in names:
            print(f"running {name} ...", flush=True)
            results.append(run_cli(name, url, model, args.api_key or "unused", args.timeout, args.lean, isolate))
            report(results[-1])
            if results[-1]["passed"] and not args.keep:
                shutil.rmtree(results[-1]["folder"], ignore_errors=True)
    finally:
        if server is not None:
            stop_server(server)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as error:  # npm install failed
        die(str(error))
