"""The one thread that makes every call into a llama.cpp-family library, whoever asks.

ggml's CPU kernels run on OpenMP, whose runtime keeps a pool of worker threads per calling
thread. Once a process holds more of them than it has cores (a model loaded on one thread,
decoded on another), libgomp stops spinning at barriers and sleeps on a futex at every one of
the hundreds per forward: decoding ran at 0.6x (the server, which calibrated on one thread and
decoded on another) or worse (docs/notebook.md, the Zen 5 entry, "The server's tax"). Routing loading,
decoding and freeing through this thread keeps one pool whatever thread the caller is on; a
call costs one hand-over (tens of microseconds) against a forward's tens of milliseconds.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class LibraryThread:
    def __init__(self, name: str = "specdec-llama"):
        self._name = name
        self._jobs: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()

    def call(self, function: Callable[..., T], *args) -> T:
        """function(*args) on the library thread; its result, or its exception re-raised here."""
        if threading.current_thread() is self._thread:
            return function(*args)
        self._ensure_started()
        done = threading.Event()
        outcome: list = []
        self._jobs.put((function, args, done, outcome))
        done.wait()
        ok, value = outcome[0]
        if ok:
            return value
        raise value

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is None:
                # A daemon: a library call that never returns (a stalled backend) must not keep
                # the process from exiting.
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            function, args, done, outcome = self._jobs.get()
            try:
                outcome.append((True, function(*args)))
            except BaseException as exc:  # handed to the caller, who raises it
                outcome.append((False, exc))
            finally:
                done.set()


library_thread = LibraryThread()  # the process's one
