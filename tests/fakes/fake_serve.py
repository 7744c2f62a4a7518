"""`specdec serve` on fake models: a real server process (the CLI, uvicorn, signals) whose engine
is the weightless fake with the timing of `TimedFakeBackend`, for tests and measurements.

    python tests/fakes/fake_serve.py serve --port 8123 --model fake.gguf [serve flags]

The fake forwards' costs come from the environment (seconds): SPECDEC_FAKE_FORWARD,
SPECDEC_FAKE_ROW, SPECDEC_FAKE_PROMPT_ROW (target; the draft model costs a third of them).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `fakes` when run as a script

SRC = str(Path(__file__).resolve().parents[2] / "src")


def fake_engine(models, n_slots: int = 1, engine=None):
    from fakes.timed_backend import TimedFakeBackend

    from specdec.engine.engine import Engine, EngineConfig

    costs = [float(os.environ.get(name, "0")) for name in
             ("SPECDEC_FAKE_FORWARD", "SPECDEC_FAKE_ROW", "SPECDEC_FAKE_PROMPT_ROW")]
    target = TimedFakeBackend(*costs, seed=7)
    draft = TimedFakeBackend(*(cost / 3 for cost in costs), seed=7, noise=0.6)
    return Engine(target, draft, engine or EngineConfig(), n_slots=n_slots)


def main(argv: list[str]) -> int:
    import specdec.runtime

    specdec.runtime.load_engine = fake_engine  # `specdec serve` builds its engine through this
    from specdec.cli import main as specdec_main

    return specdec_main(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(flags: list[str], costs: Optional[dict[str, float]] = None, command: Optional[list[str]] = None,
            start_timeout: float = 120.0, env: Optional[dict[str, str]] = None,
            log: Optional[BinaryIO] = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Runs `specdec serve FLAGS` (on fake models unless `command` is given: e.g. the real
    `[python, -m, specdec.cli]`) on a free port until /health answers; yields (base_url, process)
    and kills the process at the end if it is still running. `env` is added to this process's
    environment. Its stderr (the log) goes to `log`, or else to a temporary file; either is
    printed if it fails to start."""
    import tempfile

    import httpx

    port = free_port()
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update({f"SPECDEC_FAKE_{name.upper()}": str(value) for name, value in (costs or {}).items()})
    command = command or [sys.executable, __file__]
    owned = log is None
    log = tempfile.TemporaryFile() if log is None else log
    process = subprocess.Popen([*command, "serve", "--port", str(port), *flags], env=env,
                               stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                # ours, not another server that took the free port meanwhile (a real model loads for a minute)
                if httpx.get(url + "/health", timeout=5).status_code == 200 and listens(process.pid, port):
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"the server did not start:\n{log.read().decode(errors='replace')[-4000:]}")
            time.sleep(0.05)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if owned:
            log.close()


def listens(pid: int, port: int) -> bool:
    """The process listens on the TCP port (Linux: /proc; elsewhere, assumed)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return True
    sockets = set()
    for fd in fds:
        try:
            sockets.add(os.readlink(fd))
        except OSError:  # closed meanwhile
            pass
    return any(fields[1].endswith(f":{port:04X}") and fields[3] == "0A" and f"socket:[{fields[9]}]" in sockets
               for fields in (line.split() for line in table))  # 0A: LISTEN


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of a process now (VmRSS) and at its peak so far (VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "peak": int(fields["VmHWM"].split()[0]) / 1024}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
