"""The drafter interface: who proposes tokens.

`context` is always every committed token: the prompt, the generated text so far, and the last
committed token, which the target has not evaluated yet.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator, Optional, Sequence, TypeVar

import numpy as np

from specdec.drafters.history import TenantHistory
from specdec.types import Proposal, SamplingParams

if TYPE_CHECKING:
    from specdec.backends.sequence import CachedSequence
    from specdec.grammar.constraint import Constraint


@dataclass(frozen=True)
class DraftForward:
    """A forward a proposal needs from its draft model: `tokens` appended to `sequence`'s cache."""

    sequence: "CachedSequence"
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class DraftReply:
    """A DraftForward's answer: the logits of its last token, and this proposal's share of the
    forward's seconds (all of them when it ran alone)."""

    logits: np.ndarray
    seconds: float


# A proposal as a generator: it yields the draft forwards it needs, one at a time, is sent each
# one's DraftReply, and returns the Proposal. The engine core runs the forwards of every stream's
# proposal together, one forward per draft position instead of one per stream.
DraftSteps = Generator[DraftForward, DraftReply, Proposal]


Planned = TypeVar("Planned")


def run_alone(steps: Generator[DraftForward, DraftReply, Planned], clock: Callable[[], float] = time.perf_counter) -> Planned:
    """A proposal's draft forwards run one by one, with no other stream's."""
    try:
        forward = next(steps)
        while True:
            started = clock()
            logits = forward.sequence.extend(forward.tokens)[-1]
            forward = steps.send(DraftReply(logits, clock() - started))
    except StopIteration as done:
        return done.value


class Drafter(ABC):
    name: str = "drafter"

    def begin(self, prompt: Sequence[int], history: Optional[TenantHistory] = None) -> None:
        """A new generation starts from this prompt; `history` is its tenant's cross-request
        history (None when it has none)."""

    def prefill(self, prompt_prefix: Sequence[int]) -> None:
        """The target has processed this much of the prompt (a chunk at a time, before `begin`): a
        drafter with a cache of its own may process it alongside."""

    def share_round(self, streams: int, tokens_left: Optional[int] = None, draft_sharers: int = 1,
                    rows_before: int = 0) -> None:
        """The coming verification forward holds this many streams' rows (1: this one alone); a
        drafter that prices its proposals prices them at what they add to that forward, above the
        `rows_before` extra rows the streams planned before it put there.
        `tokens_left`: at most this many more tokens follow (the request's limit), None: unknown.
        `draft_sharers`: the streams whose draft forwards a model proposal would share (itself included)."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator,
                guide: Optional["Constraint"] = None) -> Proposal:
        """Propose up to k tokens to follow context (fewer, or none, when unsure). `guide`: the
        request's grammar; a drafter that draws token by token draws only what it allows (the
        generation cuts any proposal at the first token it forbids)."""

    def propose_steps(self, context: Sequence[int], k: int, sampling: SamplingParams, rng: np.random.Generator,
                      guide: Optional["Constraint"] = None) -> DraftSteps:
        """propose() as DraftSteps; a drafter without a model needs no forward."""
        yield from ()
        return self.propose(context, k, sampling, rng, guide)

    def observe(self, proposal: Proposal, num_accepted: int, verify_seconds: Optional[float]) -> None:
        """Learn from a round's outcome (and its target forward's time, when it was timed alone)."""


class NoDrafter(Drafter):
    """Method `off`: plain target decoding, the baseline every speedup is measured against."""

    name = "off"

    def propose(self, context, k, sampling, rng, guide=None) -> Proposal:
        return Proposal(())
