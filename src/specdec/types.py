"""Small frozen dataclasses passed between the engine's stages.

Naming: `target_*` is the model whose output we must reproduce, `draft_*` the cheap proposer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from specdec.drafters.registry import method_names  # the drafting methods by name (drafters/registry.py)

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
# auto: never measurably slower than plain decoding, faster where drafting pays (docs/notebook.md, "Adaptive speculation")
DEFAULT_METHOD = "auto"
DEFAULT_NUM_DRAFT_TOKENS = 3


class SpecdecError(Exception):
    """An error meant for the user: its message is one clear sentence, shown without a traceback."""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target's logits.

    temperature == 0 means greedy (argmax). The same transform is applied in plain and speculative
    decoding, so speculation never changes the distribution being sampled.

    logit_bias (OpenAI's): (token id, bias) pairs, sorted by id, added to the target's logits before
    every other transform (and the grammar's mask); -100 bans a token outright. A mapping or any
    iterable of pairs is accepted and stored in that canonical form.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.logit_bias != ():
            object.__setattr__(self, "logit_bias", _canonical_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise SpecdecError("temperature must be >= 0.")
        if self.top_k < 0:
            raise SpecdecError("top_k must be >= 0 (0 disables it).")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecdecError("top_p must be in (0, 1].")
        if not 0.0 <= self.min_p <= 1.0:
            raise SpecdecError("min_p must be in [0, 1].")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise SpecdecError("logit_bias names a token id more than once.")
        for token, bias in self.logit_bias:
            if token < 0:
                raise SpecdecError(f"logit_bias token ids must be >= 0, not {token}.")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise SpecdecError(f"logit_bias values must be in [-100, 100]; token {token} has {bias}.")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise if logit_bias names a token outside a vocabulary of `vocab_size` tokens."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise SpecdecError(f"logit_bias names token id {self.logit_bias[-1][0]}, "
                               f"but the model's vocabulary has only {vocab_size} tokens.")


def _canonical_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """A logit_bias given as a mapping or pairs -> (token id, bias) pairs sorted by id. Ids may be
    ints or decimal strings (JSON's object keys); duplicates are kept for validate() to refuse."""
    try:
        items = bias.items() if isinstance(bias, Mapping) else bias
        pairs = [(_token_id(token), _bias_value(value)) for token, value in items]
    except (TypeError, ValueError) as exc:
        raise SpecdecError("logit_bias must map token ids (integers) to numbers.") from exc
    return tuple(sorted(pairs, key=lambda pair: pair[0]))


def _token_id(token: Any) -> int:
    if isinstance(token, str) and token.strip().lstrip("+-").isdigit():
        return int(token)
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
        raise TypeError(token)
    return int(token)


def _bias_value(value: Any) -> float:
    if isinstance(value, (bool, str)):
        raise TypeError(value)
    return float(value)


@dataclass(frozen=True)
class SpecConfig:
    """Which drafter proposes tokens, and how many per round."""

    method: str = DEFAULT_METHOD
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS

    def validate(self) -> None:
        if self.method not in method_names():
            raise SpecdecError(f"unknown speculative method {self.method!r}; choose one of {', '.join(method_names())}.")
        if not 0 <= self.num_draft_tokens <= 32:
            raise SpecdecError("num_draft_tokens must be between 0 and 32.")


GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "regex")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the generated text (specdec/grammar/): `kind` one of GRAMMAR_KINDS, `source`
    the JSON Schema as a JSON string ("" for json_object: any JSON object), a Lark grammar in
    llguidance's dialect, or a regular expression."""

    kind: str
    source: str = ""
    # The spec compiled for the target (grammar/compiler.py), where the server did so on admission.
    compiled: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: Optional[int] = 128  # None = until a stop or the context limit
    sampling: SamplingParams = SamplingParams()
    spec: SpecConfig = SpecConfig()
    stop: tuple[str, ...] = ()
    # Tokens that end this request as the backend's end-of-generation tokens do (FIM's ends, server/fim.py).
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    tenant: Optional[str] = None  # whose cross-request history drafts for it (None: anonymous)
    cache_prompt: bool = True  # reuse a cached prefix of the prompt (llama-server's field); False: process it all
    grammar: Optional[GrammarSpec] = None  # constrained decoding: every method masks by it alike
    # Log-probabilities (sampling/logprobs.py): how many top alternatives per generated token,
    # None = none computed (no cost); prompt_logprobs the same for the prompt's tokens (echo).
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def validate(self) -> None:
        self.sampling.validate()
        self.spec.validate()


@dataclass(frozen=True)
class Proposal:
    """What a drafter proposes for the positions after the committed text.

    draft_probs is None for a deterministic drafter (n-gram): the acceptance rule treats it as one-hot.
    """

    draft_tokens: tuple[int, ...]
    draft_probs: Optional[np.ndarray] = None  # [k, vocab]
    source: str = ""


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one proposal.

    accepted_tokens: the draft prefix the target agrees with.
    next_token: the recovered token after a rejection, or the bonus token after full acceptance.
    """

    accepted_tokens: tuple[int, ...]
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target's distribution at its position, and the
    `top` most likely tokens there as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RoundOutcome:
    """One decoding round as the stream reports it (server/speculative.py): the proposal's source
    ("" when nothing was proposed), how many tokens it proposed, how many the target accepted,
    and the proposed tokens it rejected (the playground shows them faintly)."""

    source: str
    proposed: int
    accepted: int
    rejected_token_ids: tuple[int, ...] = ()


@dataclass
class StreamEvent:
    """One step of a streamed generation: new text and tokens; the last event carries the result."""

    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled" on the last event
    stats: Optional[dict] = None  # GenerationStats.as_dict() on the last event
    # Who produced each of token_ids: "target" (the target's own), or the proposal's source whose
    # token the target accepted ("ngram", "cache", "draft", "hybrid")
    token_sources: list[str] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None  # one per token_ids entry, when the request asked
    round: Optional[RoundOutcome] = None  # the round this event ends (None: a cancellation)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
