"""The drafter interface: who proposes tokens.

`context` is always every committed token: the prompt, the generated text so far, and the last
committed token, which the target has not evaluated yet.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from specdec.drafters.history import TenantHistory
from specdec.types import Proposal, SamplingParams

if TYPE_CHECKING:
    from specdec.grammar.constraint import Constraint


class Drafter(ABC):
    name: str = "drafter"

    def begin(self, prompt: Sequence[int], history: Optional[TenantHistory] = None) -> None:
        """A new generation starts from this prompt; `history` is its tenant's cross-request
        history (None when it has none)."""

    def prefill(self, prompt_prefix: Sequence[int]) -> None:
        """The target has processed this much of the prompt (a chunk at a time, before `begin`): a
        drafter with a cache of its own may process it alongside."""

    def share_round(self, streams: int, tokens_left: Optional[int] = None) -> None:
        """The coming verification forward holds this many streams' rows (1: this one alone); a
        drafter that prices its proposals prices them at what they add to that forward.
        `tokens_left`: at most this many more tokens follow (the request's limit), None: unknown."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator,
                guide: Optional["Constraint"] = None) -> Proposal:
        """Propose up to k tokens to follow context (fewer, or none, when unsure). `guide`: the
        request's grammar; a drafter that draws token by token draws only what it allows (the
        generation cuts any proposal at the first token it forbids)."""

    def observe(self, proposal: Proposal, num_accepted: int, verify_seconds: Optional[float]) -> None:
        """Learn from a round's outcome (and its target forward's time, when it was timed alone)."""


class NoDrafter(Drafter):
    """Method `off`: plain target decoding, the baseline every speedup is measured against."""

    name = "off"

    def propose(self, context, k, sampling, rng, guide=None) -> Proposal:
        return Proposal(())
