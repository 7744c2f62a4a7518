"""Fill-in-the-middle (FIM): `/v1/completions` with a `suffix`, and llama-server's `POST /infill`.

A FIM prompt is the model's own special tokens around the user's text, e.g. Qwen2.5-Coder's
`<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`; the model writes the middle. The
FIM tokens are found in the vocabulary by their text (FIM_SPELLINGS); the user's text is always
tokenized as plain text, so `<|file_sep|>` written in a source file stays those characters.

`/infill` takes llama-server's request (input_prefix, input_suffix, input_extra, prompt, ...) so
that editor plugins written for llama-server (llama.vscode, llama.vim) work unchanged, and
renders it as llama.cpp's `format_infill` does (tools/server): Qwen's repository-level layout

    <|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text}...<|file_sep|>filename\\n
    <|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>

with the prefix cut to its last 3/4 of a 2,048-token window, the suffix to its first 1/4, and the
extra chunks to what the context holds beside them (their oldest tokens go first). Its answer is
llama-server's JSON (`content`, `stop`, `timings`, ...), or with `stream` its `data: {...}` events
ending in one with `"stop": true` (llama-server sends no `[DONE]` here).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional, Sequence, Union

from pydantic import AfterValidator, Field
from starlette.requests import Request
from starlette.responses import Response

from specdec.backends.base import Backend
from specdec.server.errors import APIError, bad_request, register_field_names
from specdec.server.limits import PROMPT_BYTES_PER_TOKEN
from specdec.server.protocol import (
    TOKEN_LIMIT, Int, MinP, Seed, SpeculativeField, Stop, Temperature, TopK, TopP, _neutral, _Strict, integer,
)
from specdec.server.serving import Collected, ServerState, ignored_fields, respond, state_of, submit, tenant_of
from specdec.server.sse import KEEPALIVE, sse_data, sse_error
from specdec.server.tickets import Started, Ticket
from specdec.types import GenerationRequest, SamplingParams, SpecdecError, StreamEvent


# (prefix, suffix, middle, pad, repository, file separator) of Qwen2.5-Coder (and CodeGemma),
# StarCoder, DeepSeek-Coder; the last three may be missing. (CodeLlama's ▁<PRE> spelling is not here.)
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<reponame>", "<file_sep>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, None),
)
INFILL_BATCH = 2048  # llama-server's default --batch-size, which sizes its infill window
REPOSITORY_NAME = "myproject"  # what llama-server names the repository (it takes no name)
CURRENT_FILE = "filename"  # and the file being edited
# llama-server's defaults for what a request leaves out (common_params_sampling).
INFILL_TEMPERATURE, INFILL_TOP_K, INFILL_TOP_P, INFILL_MIN_P = 0.8, 40, 0.95, 0.05
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's LLAMA_DEFAULT_SEED (and -1, the same as a uint32): a random seed
MAX_EXTRA_CHUNKS = 256


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repository: Optional[int]
    file_separator: Optional[int]
    leading: tuple[int, ...]  # what the tokenizer puts first (a BOS), if anything
    ends: frozenset[int]  # end an answer, besides the backend's end-of-generation tokens

    def plain(self, backend: Backend, text: str, param: str = "prompt") -> list[int]:
        try:
            return backend.tokenize(text, add_special=False, parse_special=False) if text else []
        except UnicodeError:
            raise bad_request(f"{param}: the text is not valid Unicode (a lone surrogate?).", param) from None


def _special(backend: Backend, text: Optional[str]) -> Optional[int]:
    """The id of the special token spelled `text`, or None (absent, or plain text there)."""
    if text is None:
        return None
    ids = backend.tokenize(text, add_special=False, parse_special=True)
    if len(ids) != 1 or backend.tokenize(text, add_special=False, parse_special=False) == ids:
        return None
    return ids[0]


_FOUND: "weakref.WeakKeyDictionary[Backend, Optional[FimTokens]]" = weakref.WeakKeyDictionary()


def fim_tokens(backend: Backend) -> Optional[FimTokens]:
    """The model's FIM tokens, or None when its vocabulary has none we know (looked up once per backend)."""
    if backend not in _FOUND:
        _FOUND[backend] = _find_fim_tokens(backend)
    return _FOUND[backend]


def _find_fim_tokens(backend: Backend) -> Optional[FimTokens]:
    for spelling in FIM_SPELLINGS:
        prefix, suffix, middle, pad, repository, separator = (_special(backend, text) for text in spelling)
        if prefix is None or suffix is None or middle is None:
            continue
        leading = backend.tokenize("", add_special=True, parse_special=False)
        ends = frozenset(t for t in (pad, repository, separator) if t is not None)
        return FimTokens(prefix, suffix, middle, repository, separator, tuple(leading[:1]), ends)
    return None


def require_fim(backend: Backend, param: str) -> FimTokens:
    tokens = fim_tokens(backend)
    if tokens is None:
        raise bad_request(f"{param}: this model has no fill-in-the-middle tokens (such as <|fim_prefix|>), so it "
                          "cannot complete between a prefix and a suffix.", param, "fim_unsupported")
    return tokens


def encode_fim(backend: Backend, prefix: Union[str, Sequence[int]], suffix: str) -> list[int]:
    """`/v1/completions` with a suffix: the prompt (text, or token ids taken as they are) and the
    suffix in the model's FIM format, both as plain text."""
    fim = require_fim(backend, "suffix")
    prefix_ids = list(prefix) if not isinstance(prefix, str) else fim.plain(backend, prefix)
    return [*fim.leading, fim.prefix, *prefix_ids, fim.suffix, *fim.plain(backend, suffix, "suffix"), fim.middle]


def fim_stop_tokens(backend: Backend) -> frozenset[int]:
    fim = fim_tokens(backend)
    return fim.ends if fim is not None else frozenset()


# -- /infill: the request ------------------------------------------------------------------------
SAMPLER_NAMES = {  # llama.cpp's names, aliases and one-letter codes -> the canonical name
    **{name: name for name in ("dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature", "infill",
                               "penalties", "top_n_sigma")},
    "top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "min-p": "min_p", "typical_p": "typ_p",
    "typical-p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "temp": "temperature",
    "top-n-sigma": "top_n_sigma",
}
SAMPLER_CODES = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature",
                 "i": "infill", "e": "penalties", "s": "top_n_sigma"}
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


def _samplers(value: Union[list[str], str, None]) -> Optional[list[str]]:
    if value is None:
        return None
    if isinstance(value, str):  # llama-server's compact form, one letter a sampler ("kpt")
        unknown = [c for c in value if c not in SAMPLER_CODES]
        if unknown:
            raise ValueError(f"unknown sampler code {unknown[0]!r}; known: {''.join(SAMPLER_CODES)}")
        return [SAMPLER_CODES[c] for c in value]
    unknown = [name for name in value if name not in SAMPLER_NAMES]
    if unknown:
        raise ValueError(f"unknown sampler {unknown[0]!r}; known: {', '.join(sorted(set(SAMPLER_NAMES.values())))}")
    return [SAMPLER_NAMES[name] for name in value]


def _neutral_number(value: float) -> Any:
    return _neutral(Annotated[Optional[float], Field(allow_inf_nan=False)], f"{value:g}", lambda v: v == value,
                    [{"const": value}])


AnyNumber = Annotated[Optional[float], Field(allow_inf_nan=False)]  # a parameter of a sampler left off
# This route's own neutral-only types: the OpenAI routes' may change as they learn to honour more.
# mypy takes no call as a type: it sees the aliases that integer() and _neutral() build as the values they hold.
if TYPE_CHECKING:
    Penalty = Optional[float]
    ZeroOnly = Optional[int]
    FalseOnly = Optional[bool]
    EmptyList = Optional[list[Any]]
    NotAboveZero = Optional[float]
    AtMostOne = Optional[int]
    EmptyText = Optional[str]
    EmptyObject = Optional[Union[dict[str, Any], list[Any]]]
    AnySlot = Optional[int]
    NPredict = Optional[int]
    NIndent = Optional[int]
    Int32 = Optional[int]
    OneOnlyNumber = Optional[float]
    ZeroOnlyNumber = Optional[float]
else:
    Penalty = _neutral(AnyNumber, "0", lambda v: v == 0, [{"const": 0}])
    ZeroOnly = _neutral(Optional[Int], "0", lambda v: v == 0, [{"const": 0}])
    FalseOnly = _neutral(Optional[bool], "false", lambda v: v is False, [{"const": False}])
    EmptyList = _neutral(Optional[list[Any]], "an empty list", lambda v: not v, [{"type": "array", "maxItems": 0}])
    NotAboveZero = _neutral(AnyNumber, "a value <= 0 (disabled)", lambda v: v <= 0, [{"maximum": 0}])
    AtMostOne = _neutral(Optional[Int], "a value <= 1", lambda v: v <= 1, [{"maximum": 1}])
    EmptyText = _neutral(Optional[str], '""', lambda v: v == "", [{"const": ""}])
    EmptyObject = _neutral(Optional[Union[dict[str, Any], list[Any]]], "an empty object or list", lambda v: not v,
                           [{"maxProperties": 0}])
    AnySlot = _neutral(Optional[Int], "-1 (any slot)", lambda v: v == -1, [{"const": -1}])
    NPredict = Optional[integer(ge=-1, le=TOKEN_LIMIT)]
    NIndent = Optional[integer(ge=0, le=TOKEN_LIMIT)]
    Int32 = Optional[integer(ge=-TOKEN_LIMIT - 1, le=TOKEN_LIMIT)]  # llama-server's int fields: a huge one is a 400
    OneOnlyNumber = _neutral_number(1.0)
    ZeroOnlyNumber = _neutral_number(0.0)


class InfillChunk(_Strict):
    text: str  # required, as llama-server requires it
    filename: str = "tmp"  # llama-server's name for a chunk without one
    time: Any = None  # llama.vim's record of when it picked the chunk: llama-server reads nothing from it either


class InfillRequest(_Strict):
    """llama-server's /infill body. Fields it takes that would change the answer but that this
    server does not implement are accepted only at their neutral values (as on the OpenAI
    routes); `t_max_prompt_ms` is read and unused, as llama-server does; the `infill` sampler
    is accepted and not applied (docs/server.md)."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[InfillChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = []
    prompt: str = ""  # text the answer continues, after the prefix (llama.vim: the cursor line's start)
    model: Optional[str] = None  # llama-server serves one model and reads no name; neither does this route
    n_predict: NPredict = None  # -1: until the context or the server's --max-tokens cap
    max_tokens: NPredict = None  # llama-server's alias of n_predict
    n_indent: NIndent = None
    t_max_predict_ms: Int32 = None
    t_max_prompt_ms: Int32 = None
    temperature: Temperature = None
    top_k: TopK = None
    top_p: TopP = None
    min_p: MinP = None
    seed: Seed = None
    stop: Stop = None
    stream: Optional[bool] = False
    cache_prompt: Optional[bool] = None
    samplers: Annotated[Union[list[str], str, None], AfterValidator(_samplers)] = None
    response_fields: Optional[list[str]] = None
    return_tokens: Optional[bool] = None
    ignore_eos: Optional[bool] = None
    speculative_decoding: SpeculativeField = None
    # Samplers this server does not run, at the values that switch them off (llama-server's defaults).
    repeat_penalty: OneOnlyNumber = None
    repeat_last_n: Int32 = None
    penalty_last_n: Int32 = None  # llama.vim's name for repeat_last_n
    penalize_nl: Optional[bool] = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    typical_p: OneOnlyNumber = None
    dynatemp_range: ZeroOnlyNumber = None
    dynatemp_exponent: AnyNumber = None
    mirostat: ZeroOnly = None
    mirostat_tau: AnyNumber = None
    mirostat_eta: AnyNumber = None
    xtc_probability: ZeroOnlyNumber = None
    xtc_threshold: AnyNumber = None
    dry_multiplier: ZeroOnlyNumber = None
    dry_base: AnyNumber = None
    dry_allowed_length: Int32 = None
    dry_penalty_last_n: Int32 = None
    dry_sequence_breakers: Optional[list[str]] = None
    top_n_sigma: NotAboveZero = None
    min_keep: AtMostOne = None
    n_probs: ZeroOnly = None
    post_sampling_probs: Optional[bool] = None
    logit_bias: EmptyObject = None
    grammar: EmptyText = None
    json_schema: EmptyObject = None
    lora: EmptyList = None
    id_slot: AnySlot = None
    n_keep: Int32 = None  # context shifting, which this server never does (a prompt must fit)
    n_discard: Int32 = None
    timings_per_token: FalseOnly = None


register_field_names([*InfillRequest.model_fields, *InfillChunk.model_fields])


@dataclass(frozen=True)
class InfillSettings:
    sampling: SamplingParams
    samplers: tuple[str, ...]  # those applied, in the engine's order
    n_predict: int  # -1: no limit of the request's own


def infill_settings(body: InfillRequest) -> InfillSettings:
    """Sampling as llama-server would do it: its defaults, and a sampler left out of `samplers`
    switched off (without `temperature` in the list, the distribution is the model's own)."""
    chosen = set(body.samplers if body.samplers is not None else DEFAULT_SAMPLERS)
    temperature = INFILL_TEMPERATURE if body.temperature is None else body.temperature
    temperature = temperature if "temperature" in chosen else 1.0
    top_k = (INFILL_TOP_K if body.top_k is None else max(0, body.top_k)) if "top_k" in chosen else 0
    top_p = (INFILL_TOP_P if body.top_p is None else body.top_p) if "top_p" in chosen else 1.0
    min_p = (INFILL_MIN_P if body.min_p is None else body.min_p) if "min_p" in chosen else 0.0
    seed = None if body.seed is None or body.seed in RANDOM_SEEDS else body.seed % 2**64
    sampling = SamplingParams(temperature=max(0.0, temperature), top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    applied = tuple(name for name in ("temperature", "top_k", "top_p", "min_p") if name in chosen)
    n_predict = body.n_predict if body.n_predict is not None else body.max_tokens if body.max_tokens is not None else -1
    return InfillSettings(sampling, applied, n_predict)


def check_infill_size(backend: Backend, body: InfillRequest) -> None:
    """Refuse, before any of it is tokenized, text that no context could hold: the prefix and
    suffix are cut to their windows below, the prompt and each extra chunk are not."""
    limit = backend.n_ctx * PROMPT_BYTES_PER_TOKEN
    texts = [("prompt", body.prompt)] + [(f"input_extra[{i}]", chunk.text + chunk.filename)
                                         for i, chunk in enumerate(body.input_extra)]
    for param, text in texts:
        if len(text) > limit:
            raise bad_request(f"{param}: {len(text)} characters of text cannot fit a context of {backend.n_ctx} "
                              "tokens.", param, "context_length_exceeded")


def encode_infill(backend: Backend, body: InfillRequest, n_predict: int) -> list[int]:
    """llama.cpp's format_infill (tools/server), the user's text all plain."""
    fim = require_fim(backend, "input_prefix")
    n_ctx = backend.n_ctx
    window = min(INFILL_BATCH, n_ctx // 2)  # a context under two batches would leave no room beside them
    prefix_room, suffix_room_max = 3 * (window // 4), window // 4
    # Text beyond its tokens' room is never tokenized (a token holds at most PROMPT_BYTES_PER_TOKEN characters).
    prefix_text = body.input_prefix[-prefix_room * PROMPT_BYTES_PER_TOKEN:]
    suffix_text = body.input_suffix[:suffix_room_max * PROMPT_BYTES_PER_TOKEN]
    prefix, suffix, prompt = (fim.plain(backend, text, param) for text, param in (
        (prefix_text, "input_prefix"), (suffix_text, "input_suffix"), (body.prompt, "prompt")))
    extra: list[int] = []
    if fim.repository is not None:
        extra += [fim.repository, *fim.plain(backend, REPOSITORY_NAME + "\n")]
    chunks: list[InfillChunk] = []
    size = 0
    for chunk in reversed(body.input_extra):  # the newest chunks last; the oldest are cut first
        chunks.insert(0, chunk)
        size += len(chunk.text) + len(chunk.filename)
        if size > n_ctx * PROMPT_BYTES_PER_TOKEN:
            break
    for chunk in chunks:
        if fim.file_separator is not None:
            extra += [fim.file_separator, *fim.plain(backend, chunk.filename + "\n", "input_extra")]
        else:
            extra += fim.plain(backend, "\n\n--- snippet ---\n\n")
        extra += fim.plain(backend, chunk.text, "input_extra")
    if fim.file_separator is not None:
        extra += [fim.file_separator, *fim.plain(backend, CURRENT_FILE + "\n")]
    prefix_take = min(len(prefix), prefix_room)
    suffix_take = min(len(suffix), max(0, suffix_room_max - (2 + len(prompt))))
    extra_take = min(max(0, n_ctx - window - 2 * n_predict), len(extra))
    return [*extra[len(extra) - extra_take:], *fim.leading, fim.prefix, *prefix[len(prefix) - prefix_take:],
            *prompt, fim.suffix, *suffix[:suffix_take], fim.middle]


def infill_generation_request(state: ServerState, body: InfillRequest, settings: InfillSettings,
                              prompt_ids: list[int], tenant: Optional[str]) -> GenerationRequest:
    n_ctx = state.engine.target.n_ctx
    if len(prompt_ids) >= n_ctx:
        raise bad_request(f"input_prefix: the infill prompt has {len(prompt_ids)} tokens but the context holds only "
                          f"{n_ctx}.", "input_prefix", "context_length_exceeded")
    # llama-server generates until the context is full; so does this route, within its cap.
    from specdec.server.convert import speculation  # convert.py imports this module

    limit = state.config.max_tokens if settings.n_predict < 0 else settings.n_predict
    request = GenerationRequest(
        prompt_token_ids=tuple(prompt_ids),
        max_tokens=min(limit, n_ctx - len(prompt_ids)),
        sampling=settings.sampling,
        spec=speculation(body.speculative_decoding, state.config, state.engine),
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=fim_stop_tokens(state.engine.target),
        ignore_eos=bool(body.ignore_eos),
        tenant=tenant,
        cache_prompt=body.cache_prompt is not False,
    )
    try:
        request.validate()
    except SpecdecError as exc:
        raise bad_request(str(exc)) from None
    return request


# -- /infill: the answer -------------------------------------------------------------------------
class InfillLimits:
    """llama-server's two cuts of an infill answer, on its text as it arrives:
    `n_indent`: a line after the first that starts less indented ends the answer, right before
    its first non-blank character (a blank line counts: it starts with no indentation);
    `t_max_predict_ms`: once a newline was generated, the answer ends after that much time."""

    def __init__(self, n_indent: int, t_max_predict_ms: int, started: float,
                 clock: Callable[[], float] = time.monotonic):
        self.n_indent = n_indent
        self.deadline = started + t_max_predict_ms / 1000 if t_max_predict_ms > 0 else None
        self.clock = clock
        self.cut = False
        self.has_newline = False
        self._indent: Optional[int] = None  # the indentation of the line being read; None: not checked

    def feed(self, text: str) -> str:
        """The part of `text` the answer keeps; sets `cut` when the answer ends here."""
        if self.cut:
            return ""
        kept = text
        if self.n_indent > 0:
            for i, char in enumerate(text):
                if self._indent is not None:
                    if char in " \t":
                        self._indent += 1
                        continue
                    if self._indent < self.n_indent:
                        kept, self.cut = text[:i], True
                        break
                    self._indent = None
                if char == "\n":
                    self._indent = 0
        self.has_newline = self.has_newline or "\n" in kept
        if self.has_newline and self.deadline is not None and self.clock() > self.deadline:
            self.cut = True
        return kept


def _timings(stats: dict) -> dict:
    prompt_n = stats.get("prompt_tokens", 0) - stats.get("cached_prompt_tokens", 0)
    prompt_ms = 1000 * stats.get("prompt_seconds", 0.0)
    predicted_n = stats.get("generated_tokens", 0)
    predicted_ms = 1000 * max(0.0, stats.get("total_seconds", 0.0) - stats.get("prompt_seconds", 0.0))
    return {
        "cache_n": stats.get("cached_prompt_tokens", 0),
        "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
    }


def _stop_type(backend: Backend, content: str, token_ids: list[int], event: StreamEvent, stop: Sequence[str],
               cut: bool) -> tuple[str, str]:
    """llama-server's (stop_type, stopping_word): "eos", "word" (a stop string), "limit"."""
    if cut or event.finish_reason != "stop":
        return "limit", ""
    # The engine cut a stop string off the text when the tokens' own text runs past it.
    rest = backend.detokenize(token_ids)[len(content):]
    word = next((s for s in stop if s and rest.startswith(s)), None)
    return ("word", word) if word is not None else ("eos", "")


def _select(response: dict, fields: Optional[list[str]]) -> dict:
    """llama-server's `response_fields`: only those fields, a nested one under its path ("timings/prompt_n")."""
    if not fields:
        return response
    selected = {}
    for path in fields:
        value: Any = response
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            selected[path] = value
    return selected


class _Answer:
    """An infill answer as it arrives: its text (cut by InfillLimits), tokens and final event."""

    def __init__(self, state: ServerState, body: InfillRequest, settings: InfillSettings, ticket: Ticket):
        self.state, self.body, self.settings, self.ticket = state, body, settings, ticket
        self.limits: Optional[InfillLimits] = None
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_tokens = len(ticket.request.prompt_token_ids)

    def observe(self, index: int, item: Union[Started, StreamEvent]) -> None:
        """An item of an answer that is not streamed, as it arrives (a limit cancels the generation)."""
        if isinstance(item, Started):
            self.start()
        else:
            self.add(item)

    def start(self) -> None:
        self.limits = InfillLimits(self.body.n_indent or 0, self.body.t_max_predict_ms or 0, time.monotonic())

    def add(self, event: StreamEvent) -> str:
        """The text of `event` the answer keeps; cancels the generation once a limit cuts it."""
        if self.limits is None:
            self.start()
        assert self.limits is not None  # start() sets it
        was_cut = self.limits.cut
        kept = self.limits.feed(event.text)
        if not was_cut:
            self.text.append(kept)
            self.token_ids += event.token_ids
            if self.limits.cut:
                self.ticket.cancel()  # the scheduler ends it with one final event, read for its timings
        return kept

    def final(self, event: StreamEvent, stream: bool) -> dict:
        stats = event.stats or {}
        content = "".join(self.text)
        stop = self.ticket.request.stop
        stop_type, word = _stop_type(self.state.engine.target, content, self.token_ids, event, stop,
                                     self.limits is not None and self.limits.cut)
        sampling = self.settings.sampling
        response = {
            "index": 0,
            "content": "" if stream else content,  # a stream sent it already
            "tokens": [] if stream or not self.body.return_tokens else self.token_ids,
            "stop": True,
            "model": self.state.config.served_model_name,
            "tokens_predicted": len(self.token_ids),
            "tokens_evaluated": stats.get("prompt_tokens", self.prompt_tokens),
            "generation_settings": {
                "n_predict": self.settings.n_predict, "temperature": sampling.temperature, "top_k": sampling.top_k,
                "top_p": sampling.top_p, "min_p": sampling.min_p, "seed": sampling.seed, "stop": list(stop),
                "samplers": list(self.settings.samplers), "n_indent": self.body.n_indent or 0,
                "t_max_predict_ms": self.body.t_max_predict_ms or -1,
                "speculative_decoding": self.ticket.request.spec.method,
            },
            "has_new_line": "\n" in content,
            "truncated": False,  # a prompt that does not fit is refused, never shifted out of the context
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": stats.get("prompt_tokens", self.prompt_tokens) + len(self.token_ids),
            "timings": _timings(stats),
            "speculative": stats,  # this server's statistics of the request (as in the OpenAI routes' usage)
        }
        return _select(response, self.body.response_fields)

    def partial(self, text: str, token_ids: Sequence[int]) -> dict:
        return {"index": 0, "content": text, "tokens": list(token_ids) if self.body.return_tokens else [],
                "stop": False, "tokens_predicted": len(self.token_ids), "tokens_evaluated": self.prompt_tokens}


async def infill_response(request: Request, body: InfillRequest) -> Response:
    """POST /infill: the generation goes through the serving core as every other route's does."""
    state = state_of(request)
    settings = infill_settings(body)
    tenant = tenant_of(request)

    def prepare(engine) -> list[GenerationRequest]:
        check_infill_size(engine.target, body)
        prompt_ids = encode_infill(engine.target, body, settings.n_predict)
        return [infill_generation_request(state, body, settings, prompt_ids, tenant)]

    merge = await submit(request, 1, prepare)
    answer = _Answer(state, body, settings, merge.tickets[0])

    def whole(results: list[Collected]) -> dict:
        final = results[0].final
        assert final is not None  # collect() returns each choice once its final event came
        return answer.final(final, stream=False)

    return await respond(request, merge, stream=bool(body.stream), writer=lambda: InfillStream(answer),
                         whole=whole, observe=answer.observe, ignored=ignored_fields(body))


class InfillStream:
    """llama-server's infill stream (serving.StreamWriter): `data: {"content": ..., "stop": false}`
    events, then the final object with `"stop": true`, and no `[DONE]`; a failure is one error
    event (the OpenAI error object)."""

    def __init__(self, answer: _Answer):
        from specdec.server.pieces import TokenPieces

        self.answer = answer
        config = answer.state.config
        token_bytes = answer.state.engine.target.token_bytes
        self.pieces = TokenPieces(token_bytes) if config.stream_one_token_per_chunk else None

    def begin(self) -> list[bytes]:
        return []

    def item(self, index: int, item: Union[Started, StreamEvent]) -> list[bytes]:
        answer = self.answer
        if isinstance(item, Started):
            answer.start()
            return []
        chunks = []
        cut_before = answer.limits is not None and answer.limits.cut
        kept = answer.add(item)
        if not cut_before:
            # Every event goes through `pieces`, text or not: its tokens' bytes place later cuts.
            split = self.pieces.split(item.text, item.token_ids) if self.pieces is not None else [item.text]
            for i, text in enumerate(_clip(split, len(kept))):
                chunks.append(sse_data(answer.partial(text, item.token_ids if i == 0 else ())))
        if item.finish_reason is not None:
            chunks.append(sse_data(answer.final(item, stream=True)))
        return chunks

    def end(self) -> list[bytes]:
        return []

    def failure(self, error: APIError) -> list[bytes]:
        return [sse_error(error)]

    def keepalive(self) -> bytes:
        return KEEPALIVE


def _clip(pieces: list[str], length: int) -> list[str]:
    """The pieces of an event's text, cut to the first `length` characters (what a limit kept)."""
    kept = []
    for piece in pieces:
        if length <= 0:
            break
        kept.append(piece[:length])
        length -= len(piece)
    return [piece for piece in kept if piece]
