"""From a GrammarSpec to llguidance's compiled grammar, once per distinct spec (a bounded cache),
on a few grammar threads within a time limit, and the target's vocabulary as llguidance's
tokenizer (built once per backend: every token's bytes). The server compiles a request's grammar
on admission, before it is queued, so the engine's worker only copies a matcher per choice."""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from typing import Any, Callable, Hashable, Optional, Union, cast

from specdec.backends.base import Backend
from specdec.grammar.constraint import Constraint
from specdec.types import GRAMMAR_KINDS, GrammarSpec, SpecdecError

# The JSON layout OpenAI's structured outputs produce and models imitate: ", " and ": ", no newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema larger than this is refused before compiling
DEFAULT_TIME_LIMIT = 10.0  # seconds a grammar may compile on admission; past it the request is a 400
CACHE_SIZE = 64  # compiled grammars kept per target (least recently used dropped first)
WORKERS = 2  # grammar threads in the process: the cores a flood of fresh grammars can take
MAX_QUEUED = 32  # grammars waiting for a thread; past it a request is told to retry
QUEUE_WAIT_FACTOR = 3  # a compile that has not begun within this many time limits: retry later


def special_marker(text: bytes) -> bytes:
    """llguidance's spelling of a special token: its text after a 0xff byte."""
    return b"\xff" + text


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each id's bytes, the end token, a tokenizer."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for token_id in range(backend.vocab_size):
            data = backend.token_bytes(token_id)
            if not data:  # a control token renders as nothing: llguidance names it by its text
                data = special_marker(backend.fingerprint_bytes(token_id))
                self.special_token_ids.append(token_id)
            self.tokens.append(data)
        self.eos_token_id = min(backend.eog_token_ids) if backend.eog_token_ids else 0
        self.bos_token_id = None

    def __call__(self, data: bytes) -> list[int]:
        return self._backend.tokenize(data.decode("utf-8", errors="replace"), add_special=False, parse_special=False)


class GrammarTimeout(SpecdecError):
    """A grammar that took longer than the time limit to compile (its request is a 400)."""


class GrammarBusy(SpecdecError):
    """Too many grammars already waiting to be compiled (its request may retry)."""


class _Job:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.start = 0.0
        self.future: Optional[Future] = None


class _Runner:
    """The process's grammar threads: a few, so that grammars never take more cores than that, and
    never the event loop's or the engine worker's. One job per key at a time: requests that ask for
    the same grammar at once wait on one compilation."""

    def __init__(self, workers: int = WORKERS, max_queued: int = MAX_QUEUED):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="specdec-grammar")
        self._max_queued = max_queued
        self._jobs: dict[Hashable, _Job] = {}
        self._lock = threading.Lock()

    def run(self, key: Hashable, work: Callable[[], Any], limit: Optional[float], what: str) -> Any:
        """work()'s result (or its exception), waited for at most `limit` seconds of compiling
        (GrammarTimeout); a compile past its limit runs on and its result is still kept by `work`."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                if sum(not each.started.is_set() for each in self._jobs.values()) >= self._max_queued:
                    raise GrammarBusy("the server is compiling too many grammars at once; retry later.")
                job = self._jobs[key] = _Job()
                job.future = self._pool.submit(self._work, key, job, work)
        assert job.future is not None
        if limit is None:
            return job.future.result()
        # The limit counts the compilation itself, not the wait behind other requests' grammars.
        if not job.started.wait(QUEUE_WAIT_FACTOR * limit):
            raise GrammarBusy("the server's grammar compiler is busy; retry later.")
        try:
            return job.future.result(max(0.0, limit - (time.monotonic() - job.start)))
        except FutureTimeout:
            raise GrammarTimeout(f"the {what} took longer than {limit:g} s to compile; this server refuses it "
                                 f"(simplify it).") from None

    def _work(self, key: Hashable, job: _Job, work: Callable[[], Any]) -> Any:
        job.start = time.monotonic()
        job.started.set()
        try:
            return work()
        finally:
            with self._lock:
                self._jobs.pop(key, None)


_RUNNER = _Runner()


class CompiledGrammar:
    """A spec compiled for one compiler's vocabulary: a matcher never advanced, copied per generation."""

    def __init__(self, compiler: "GrammarCompiler", spec: GrammarSpec, matcher: Any):
        self.compiler = compiler
        self.spec = spec
        self._matcher = matcher
        self._lock = threading.Lock()

    def matcher(self) -> Any:
        with self._lock:  # choices of one request may start on different threads
            return self._matcher.deep_copy()


class GrammarCompiler:
    """One per target backend: compiles specs once each (a bounded LRU cache of compiled
    grammars, keyed by kind and text) and makes per-generation constraints from them."""

    def __init__(self, backend: Backend, time_limit: Optional[float] = DEFAULT_TIME_LIMIT,
                 cache_size: int = CACHE_SIZE):
        self.backend = backend
        self.time_limit = time_limit  # seconds a compilation may take on admission (None: no limit)
        self.cache_size = cache_size
        self._tokenizer = None
        self._lock = threading.Lock()
        # (kind, source) -> CompiledGrammar, or the message of the SpecdecError it raised
        self._cache: OrderedDict[tuple[str, str], Union[CompiledGrammar, str]] = OrderedDict()

    @property
    def tokenizer(self):
        with self._lock:  # the server's tokenizer threads and the engine may ask at once
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(self.backend)))
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec compiled (cached), on the grammar threads, within the time limit: GrammarTimeout
        past it, GrammarBusy when too many wait, a SpecdecError naming what is wrong if it cannot be used."""
        return self._compiled(spec, self.time_limit)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh constraint for one generation: a copy of the compiled grammar's matcher (the
        one compiled on admission where the spec carries it, else compiled now, or found cached)."""
        compiled = spec.compiled
        if not (isinstance(compiled, CompiledGrammar) and compiled.compiler is self):
            compiled = self._compiled(spec, None)  # a caller of the engine itself: no limit
        return Constraint(compiled.matcher(), self.backend.vocab_size, self.backend.eog_token_ids)

    def _compiled(self, spec: GrammarSpec, limit: Optional[float]) -> CompiledGrammar:
        key = (spec.kind, spec.source)
        found = self._cached(key)
        if found is None:
            self.tokenizer  # the vocabulary read (once, about a second) outside the time limit
            found = _RUNNER.run((id(self), key), lambda: self._build(key), limit, _name(spec.kind))
        if isinstance(found, str):
            raise SpecdecError(found)
        return found

    def _cached(self, key: tuple[str, str]) -> Union[CompiledGrammar, str, None]:
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            return found

    def _build(self, key: tuple[str, str]) -> Union[CompiledGrammar, str]:
        found = self._cached(key)  # compiled while this job waited for a thread
        if found is not None:
            return found
        kind, source = key
        try:
            found = CompiledGrammar(self, GrammarSpec(kind, source), self._matcher(kind, source))
        except SpecdecError as exc:
            found = str(exc)
        with self._lock:
            self._cache[key] = found
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return found

    def _matcher(self, kind: str, source: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, _compile(kind, source), log_level=0)
        if matcher.is_error():
            raise SpecdecError(f"the {_name(kind)} cannot be used: {_first_line(matcher.get_error())}")
        return matcher


def grammar_error(spec: GrammarSpec, limit: Optional[float] = None) -> Optional[str]:
    """Why the grammar library cannot use this spec (its first line), or None: checked without the
    vocabulary, so a request's parts can be checked before any engine is at hand. On the grammar
    threads within `limit` seconds (GrammarTimeout past it)."""
    return cast(Optional[str], _RUNNER.run(("error", spec.kind, spec.source), lambda: _error(spec), limit,
                                           _name(spec.kind)))


def _error(spec: GrammarSpec) -> Optional[str]:
    import llguidance

    try:
        message = llguidance.LLMatcher.validate_grammar(_compile(spec.kind, spec.source))
    except SpecdecError as exc:
        return str(exc)
    return None if not message or message.startswith("WARNING") else _first_line(message)


@lru_cache(maxsize=256)
def _compile(kind: str, source: str) -> str:
    import llguidance

    if kind not in GRAMMAR_KINDS:
        raise SpecdecError(f"unknown grammar kind {kind!r}; choose one of {', '.join(GRAMMAR_KINDS)}.")
    if len(source) > MAX_GRAMMAR_CHARS:
        raise SpecdecError(f"the {_name(kind)} is {len(source)} characters; at most {MAX_GRAMMAR_CHARS} are taken.")
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(source)
            if not isinstance(schema, (dict, bool)):
                raise SpecdecError("the JSON schema must be an object.")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        return llguidance.LLMatcher.grammar_from_lark(source)
    except (ValueError, RecursionError) as exc:
        raise SpecdecError(f"the {_name(kind)} cannot be used: {_first_line(str(exc))}") from None


def _name(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object format", "lark": "grammar",
            "regex": "regular expression"}[kind] if kind in GRAMMAR_KINDS else "grammar"


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "rejected by the grammar library"
    return line[:300]
