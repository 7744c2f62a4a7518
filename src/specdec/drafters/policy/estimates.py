"""What `auto` learns online: acceptance per source (per position, or per token's evidence), the
draft model's measured/priced time scale, the calibration of its confidence, and the verdicts on
shadow proposals (what a draft-free source would have proposed, scored against what was committed).

Each estimate starts from a prior worth a few observations and is updated by `observe`; none
prices anything (pricing.py) or decides anything (planner.py).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from specdec.drafters.policy.priors import EvidenceKey, evidence_key
from specdec.drafters.suffix import Continuation, Evidence


class Estimate(Protocol):
    def rates(self, length: int, evidence: Sequence[Evidence] = ()) -> list[float]:
        """[a_1, ..., a_length]: a_i, the chance position i is accepted once 1..i-1 were."""

    def observe(self, proposed: int, accepted: int, rejected: bool = True,
                evidence: Sequence[Evidence] = ()) -> None:
        """`accepted` leading positions were accepted; if `rejected`, position accepted + 1 was
        not (False when the outcome past the accepted ones is unknown)."""


@dataclass
class AcceptanceEstimate:
    """Per-position acceptance of one source (the draft model). Position i's estimate starts from
    position i-1's (the first from `prior`), worth `prior_weight` observations."""

    prior: float
    prior_weight: float = 2.0
    attempts: list[float] = field(default_factory=list)
    accepts: list[float] = field(default_factory=list)

    def rate(self, position: int) -> float:
        """a_position (1-based)."""
        return self.rates(position)[-1] if position > 0 else self.prior

    def rates(self, length: int, evidence: Sequence[Evidence] = ()) -> list[float]:
        """[a_1, ..., a_length] in one pass (`evidence` is ignored: positions say it all here)."""
        rates, rate = [], self.prior
        for i in range(length):
            if i < len(self.attempts):
                rate = (self.accepts[i] + rate * self.prior_weight) / (self.attempts[i] + self.prior_weight)
            rates.append(rate)
        return rates

    def observe(self, proposed: int, accepted: int, rejected: bool = True, evidence: Sequence[Evidence] = ()) -> None:
        reached = min(proposed, accepted + (1 if rejected else 0))
        while len(self.attempts) < reached:
            self.attempts.append(0.0)
            self.accepts.append(0.0)
        for i in range(reached):
            self.attempts[i] += 1
            self.accepts[i] += 1 if i < accepted else 0


@dataclass
class EvidenceEstimate:
    """Acceptance of a draft-free source by each token's evidence (its match length's bucket and
    the agreement of earlier occurrences): each cell starts from its prior, worth `prior_weight`
    observations. Accepting the tokens before position i lengthens its match, which its evidence
    already counts, so positions need no chaining here."""

    priors: Mapping[EvidenceKey, float]
    prior_weight: float = 4.0
    attempts: dict = field(default_factory=dict)
    accepts: dict = field(default_factory=dict)

    def rate_of(self, evidence: Evidence) -> float:
        key = evidence_key(evidence)
        prior = self.priors.get(key, 0.0)  # evidence never fit: trusted only as far as this request shows
        return (self.accepts.get(key, 0.0) + prior * self.prior_weight) / \
            (self.attempts.get(key, 0.0) + self.prior_weight)

    def rates(self, length: int, evidence: Sequence[Evidence] = ()) -> list[float]:
        return [self.rate_of(e) for e in evidence[:length]]

    def observe(self, proposed: int, accepted: int, rejected: bool = True, evidence: Sequence[Evidence] = ()) -> None:
        for i in range(min(proposed, accepted + (1 if rejected else 0))):
            key = evidence_key(evidence[i])
            self.attempts[key] = self.attempts.get(key, 0.0) + 1
            self.accepts[key] = self.accepts.get(key, 0.0) + (1 if i < accepted else 0)


class DraftTimeScale:
    """What a draft-model proposal really takes over its calibrated price (logits copies, softmax
    and the catch-up's own kernel are not in the calibrated step): the median of the last `window`
    ratios, seeded with `prior` ratios of 1, each clipped to `clip`. A property of the machine, so
    kept across requests."""

    def __init__(self, window: int = 9, prior: int = 4, clip: tuple[float, float] = (0.5, 3.0)):
        self.ratios: deque[float] = deque([1.0] * prior, maxlen=window)
        self.clip = clip
        self.value = 1.0

    def observe(self, measured: float, priced: float) -> None:
        if priced <= 0:
            return
        low, high = self.clip
        self.ratios.append(min(high, max(low, measured / priced)))
        self.value = statistics.median(self.ratios)


class ConfidenceCalibration:
    """How often the draft's confidence comes true: accepted tokens over the confidence they were
    proposed with, over verified positions, starting from `prior` of each."""

    def __init__(self, prior: float = 1.0):
        self.confidence_sum = prior
        self.accepted = prior

    @property
    def value(self) -> float:
        return self.accepted / self.confidence_sum

    def observe(self, confidences: Sequence[float], model_accepted: int) -> None:
        """`confidences` of the proposal's model tokens, of which the first `model_accepted` held."""
        for position, confidence in enumerate(confidences[:model_accepted + 1]):
            self.confidence_sum += confidence
            self.accepted += 1 if position < model_accepted else 0


@dataclass(frozen=True)
class Shadow:
    """What a draft-free source offered, unproposed, at a context length: scored once committed."""

    source: str
    context_length: int
    offer: Continuation


@dataclass(frozen=True)
class Verdict:
    """A shadow's outcome, as Estimate.observe takes it."""

    source: str
    proposed: int
    accepted: int
    rejected: bool
    evidence: tuple[Evidence, ...]


def score_shadows(shadows: Sequence[Shadow], context: Sequence[int]) -> tuple[list[Verdict], list[Shadow]]:
    """(verdicts on the shadows that the tokens committed since decide, the shadows still pending:
    every committed token matched, and more are needed to judge them)."""
    verdicts, pending = [], []
    for shadow in shadows:
        committed = context[shadow.context_length:]
        tokens = shadow.offer.tokens
        matched = 0
        for proposed, actual in zip(tokens, committed):
            if proposed != actual:
                break
            matched += 1
        if matched == len(tokens) or matched < len(committed):
            verdicts.append(Verdict(shadow.source, len(tokens), matched, matched < len(tokens), shadow.offer.evidence))
        else:
            pending.append(shadow)
    return verdicts, pending
