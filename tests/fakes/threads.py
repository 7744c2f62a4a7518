"""Waiting on a server under test from the test's own thread."""
import threading
import time


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def in_thread(fn, *args, **kwargs):
    """Runs fn in a daemon thread; returns the thread and a dict that gets "value" or "error"."""
    result = {}

    def run():
        try:
            result["value"] = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result
