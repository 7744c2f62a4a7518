"""Running the app on loopback in a background thread (tests, benchmarks, examples)."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now: the one helper for tests, scripts and bench/ (peers, serving)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", timeout: float = 10.0,
                    graceful: float = 5.0, worker_timeout: float = 300.0) -> Iterator[tuple[str, uvicorn.Server]]:
    """Yields (base_url, server); the server stops when the block ends. `graceful`: the drain's
    grace period, should the test call `server.handle_exit`."""
    from specdec.server.drain import make_server

    port = free_port(host)
    app.state.specdec.drain.grace = graceful
    server = make_server(app, host, port, "warning")
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout)
        # The caller may close the engine next: never while the worker is still inside it.
        if not app.state.specdec.scheduler.join(worker_timeout):
            raise RuntimeError(f"the scheduler's worker is still busy {worker_timeout:g}s after the server stopped")
