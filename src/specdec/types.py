"""Small frozen dataclasses passed between the engine's stages.

Naming: `target_*` is the model whose output we must reproduce, `draft_*` the cheap proposer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

METHODS = ("off", "ngram", "draft", "auto")
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
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None

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


@dataclass(frozen=True)
class SpecConfig:
    """Which drafter proposes tokens, and how many per round."""

    method: str = DEFAULT_METHOD
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS

    def validate(self) -> None:
        if self.method not in METHODS:
            raise SpecdecError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}.")
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
