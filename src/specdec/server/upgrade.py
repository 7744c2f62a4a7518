"""Moving a running server onto specdec's ik_llama.cpp build once it is built.

On a fresh machine `make serve` serves at once on PyPI's prebuilt ik wheel while
scripts/install.sh builds specdec's patched build in the background; `$SPECDEC_HOME/builds/
ik-pending` names the build's folder. The watcher looks every few seconds; once the build is
complete (its wheel and its unpacked library are there) and this CPU runs it, the watcher's own
thread loads the new engine from the unpacked library (the old one stays open beside it: a
library cannot be reloaded under the same path) while the old engine keeps serving: the new
engine's calls go through a library thread of its own, so the load (tens of seconds) never holds
the thread the serving engine's forwards need, and the old thread ends with the old engine, so one
OpenMP pool is left (backends/library_thread.py); it then hands
it to the scheduler, whose worker measures the new build's costs a pair of forwards between two
rounds (measured on another thread beside the busy old engine, the two builds' threads would share
the cores and make both the figures and the serving wrong), then gives new requests to it while
those already running finish on the old engine (scheduler.py). The old engine is closed once the
last request that may hold it is over (engine_users.py). Later starts load the build from the
virtualenv, where the background job has installed it.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from specdec.backends.library_thread import own_library_thread
from specdec.engine.engine import Engine
from specdec.models.registry import specdec_home

logger = logging.getLogger("specdec.server")

POLL_SECONDS = 5.0
PROGRESS_SECONDS = 60.0  # how often the log says how far the build has got
_NINJA_STEP = re.compile(rb"\[(\d+)/(\d+)\] ")
LIBRARY_ENV = "IK_LLAMA_CPP_LIB_PATH"  # the ik package's own override of the library it opens


def pending_file() -> Path:
    return specdec_home() / "builds" / "ik-pending"


def pending_build(pending: Optional[Path] = None) -> Optional[Path]:
    """The folder of the build the pending file names (None: no build is pending)."""
    try:
        return Path((pending or pending_file()).read_text().strip())
    except OSError:
        return None


def finished_build(pending: Optional[Path] = None) -> Optional[Path]:
    """The unpacked library of the pending build once it is complete and this CPU runs it."""
    from specdec.backends.bindings import ik_llama

    folder = pending_build(pending)
    if folder is None:
        return None
    library = folder / "unpacked" / "ik_llama_cpp" / "lib" / "libllama.so"
    if not any(folder.glob("ik_llama_cpp_python-*.whl")) or not library.exists() or not ik_llama.cpu_runs(library):
        return None
    return library


def build_progress(pending: Optional[Path] = None) -> Optional[tuple[int, int]]:
    """(steps done, steps) of the pending build's compiler, from its log's last ninja line."""
    folder = pending_build(pending)
    if folder is None:
        return None
    try:
        with open(folder / "build.log", "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 8192))
            steps = _NINJA_STEP.findall(log.read())
    except OSError:
        return None
    return (int(steps[-1][0]), int(steps[-1][1])) if steps else None


def provisional(engine: Engine) -> bool:
    """The engine runs ik_llama.cpp as PyPI's wheel, where specdec's build would do better."""
    if engine.model_config is None or engine.target.name != "ik_llama.cpp":
        return False
    from specdec.backends.bindings import ik_llama

    return not ik_llama.binding().one_row_exact


def upgraded_engine(engine: Engine, library: Path) -> Engine:
    """The same models on the build at `library`, with the weights repacked where the configuration
    was the rule's (runtime.default_config: repacked on specdec's build); its costs are measured
    by the scheduler's worker, between rounds."""
    from specdec.runtime import load_engine

    os.environ[LIBRARY_ENV] = str(library)  # from now on this process opens that build
    models = engine.model_config
    assert models is not None  # a provisional engine (watch_for_build), which runtime.load_engine loaded
    if models.backend_by_rule:
        models = models.with_backend(replace(models.backend, repacked=True))
    with own_library_thread("specdec-llama-new"):  # the serving engine's library thread is not held
        new = load_engine(models, n_slots=len(engine.slots), engine=engine.config)
    logger.info("specdec's ik_llama.cpp build loaded (%s) beside the serving engine", models.backend.label)
    return new


Prepare = Callable[[Engine, Path], Engine]


class BuildWatcher:
    """Polls for the background build; when it is done, loads the new engine on its own thread and
    hands it to `switch(engine)`."""

    def __init__(self, engine: Engine, switch: Callable[[Engine], None], poll: float = POLL_SECONDS,
                 prepare: Prepare = upgraded_engine, finished: Callable[[], Optional[Path]] = finished_build):
        self.engine = engine
        self.switch = switch
        self.poll = poll
        self.prepare = prepare
        self.finished = finished
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-build-watcher", daemon=True)

    def start(self) -> None:
        logger.info("serving on PyPI's ik_llama.cpp wheel while specdec's build is made in the background "
                    "(log: %s/build.log); the server switches to it when it is done",
                    pending_build() or "?")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        started = last_report = time.monotonic()
        while not self._stop.wait(self.poll):
            library = self.finished()
            if library is None and time.monotonic() - last_report >= PROGRESS_SECONDS:
                last_report = time.monotonic()
                progress = build_progress()
                if progress is not None:
                    logger.info("specdec's ik_llama.cpp build: compiled %d of %d (%.0f min so far)",
                                *progress, (last_report - started) / 60)
            if library is not None:
                logger.info("specdec's ik_llama.cpp build is ready (%s): loading it beside the serving engine", library)
                try:
                    new = self.prepare(self.engine, library)
                except Exception:
                    logger.exception("could not load the new build; serving on as before")
                    return
                if self._stop.is_set():
                    new.close()  # the server stopped meanwhile
                    return
                logger.info("switching to specdec's build once the worker has measured its costs between rounds")
                self.switch(new)
                return


def watch_for_build(engine: Engine, switch: Callable[[Engine], None]) -> Optional[BuildWatcher]:
    """A started watcher where the engine is provisional and a build is pending; else None."""
    if not pending_file().exists() or not provisional(engine):
        return None
    watcher = BuildWatcher(engine, switch)
    watcher.start()
    return watcher
