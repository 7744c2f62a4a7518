"""From a GrammarSpec to llguidance's grammar, checked once, and the target's vocabulary as
llguidance's tokenizer (built once per backend: every token's bytes)."""
from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import Optional

from specdec.backends.base import Backend
from specdec.grammar.constraint import Constraint
from specdec.types import GRAMMAR_KINDS, GrammarSpec, SpecdecError

# The JSON layout OpenAI's structured outputs produce and models imitate: ", " and ": ", no newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema larger than this is refused before compiling


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


class GrammarCompiler:
    """One per target backend: compiles specs (cached by text) and makes per-request constraints."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:  # the server's tokenizer threads and the engine may ask at once
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(self.backend)))
            return self._tokenizer

    def check(self, spec: GrammarSpec) -> str:
        """The spec as llguidance's grammar; a SpecdecError naming what is wrong if it cannot be used."""
        grammar = _compile(spec.kind, spec.source)
        import llguidance

        message = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message and not message.startswith("WARNING"):
            raise SpecdecError(f"the {_name(spec.kind)} cannot be used: {_first_line(message)}")
        return grammar

    def constraint(self, spec: GrammarSpec) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.check(spec), log_level=0)
        if matcher.is_error():
            raise SpecdecError(f"the {_name(spec.kind)} cannot be used: {_first_line(matcher.get_error())}")
        return Constraint(matcher, self.backend.vocab_size, self.backend.eog_token_ids)


def grammar_error(spec: GrammarSpec) -> Optional[str]:
    """Why the grammar library cannot use this spec (its first line), or None: checked without the
    vocabulary, so a request's parts can be checked before any engine is at hand."""
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
