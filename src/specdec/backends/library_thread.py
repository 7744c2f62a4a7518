"""The one thread that makes every call into a llama.cpp-family library, whoever asks.

ggml's CPU kernels run on OpenMP, whose runtime keeps a pool of worker threads per calling
thread. Once a process holds more of them than it has cores (a model loaded on one thread,
decoded on another), libgomp stops spinning at barriers and sleeps on a futex at every one of
the hundreds per forward: decoding ran at 0.6x (the server, which calibrated on one thread and
decoded on another) or worse (docs/notebook.md, the Zen 5 entry, "The server's tax"). Routing loading,
decoding and freeing through this thread keeps one pool whatever thread the caller is on; a
call costs one hand-over (tens of microseconds) against a forward's tens of milliseconds.
A build loaded beside the serving one (server/upgrade.py) gets a thread of its own for the time
both are open; a thread ends once the last backend calling through it is closed.
"""
from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TypeVar

T = TypeVar("T")


class LibraryThread:
    def __init__(self, name: str = "specdec-llama"):
        self._name = name
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()  # None: end if unused
        self._users = 0  # backends loaded that call through it
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()

    def call(self, function: Callable[..., T], *args) -> T:
        """function(*args) on the library thread; its result, or its exception re-raised here."""
        if threading.current_thread() is self._thread:
            return function(*args)
        done = threading.Event()
        outcome: list = []
        with self._start_lock:  # against the thread's ending (_serve): a job never waits for none
            if self._thread is None:
                # A daemon: a library call that never returns (a stalled backend) must not keep
                # the process from exiting.
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((function, args, done, outcome))
        done.wait()
        ok, value = outcome[0]
        if ok:
            return value
        raise value

    def attach(self) -> None:
        """A backend that calls through this thread was loaded."""
        with self._start_lock:
            self._users += 1

    def detach(self) -> None:
        """A backend was closed; with none left the thread ends, and its OpenMP pool with it (a
        later call starts it again)."""
        with self._start_lock:
            self._users -= 1
            if self._users <= 0 and self._thread is not None:
                self._jobs.put(None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                with self._start_lock:
                    if self._users <= 0 and self._jobs.empty():
                        self._thread = None
                        return
                continue
            function, args, done, outcome = job
            try:
                outcome.append((True, function(*args)))
            except BaseException as exc:  # handed to the caller, who raises it
                outcome.append((False, exc))
            finally:
                done.set()


library_thread = LibraryThread()  # the process's one, but for a build loaded beside it (below)
_loading = threading.local()


def for_new_backend() -> LibraryThread:
    """The thread a backend loaded now on this thread calls through: the process's one, or the one
    `own_library_thread` gave this thread."""
    return getattr(_loading, "library", None) or library_thread


@contextmanager
def own_library_thread(name: str) -> Iterator[LibraryThread]:
    """Backends loaded on this thread meanwhile call through a library thread of their own: a build
    loaded beside a serving one (server/upgrade.py) must not hold the serving engine's thread for
    the whole load, and once the old engine is closed its thread ends, so that one OpenMP pool is
    left again."""
    _loading.library = LibraryThread(name)
    try:
        yield _loading.library
    finally:
        _loading.library = None
