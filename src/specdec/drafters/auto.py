"""Method `auto`: before each round, propose whatever is expected to give the most tokens per
second under this machine's measured costs — an n-gram match, the draft model, or nothing.

Per request, each source's per-token acceptance is estimated online (a geometric model: after an
accepted token, the next is accepted with probability a). For a proposal of j tokens the expected
yield is E(j) = 1 + a + a^2 + ... + a^j tokens for a cost of t(1 + j) (plus j draft steps for the
draft model); doing nothing yields 1 token for t(1). The policy takes the best, and only
speculates when that beats plain decoding by a margin. When plain decoding wins it still probes
now and then (one cheap n-gram token, at growing intervals after each failed probe), so a stretch
of repetitive text is noticed. It only changes what is proposed, never what is accepted.

Example: t(1) = 50 ms, t(2) = 96 ms, t(4) = 180 ms, n-gram acceptance a = 0.9: one token
E = 1.9 / 96 ms = 19.8 tok/s, three tokens E = 3.44 / 180 ms = 19.1 tok/s, plain 20 tok/s ->
plain decoding (and a probe later).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from specdec.drafters.base import Drafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import find_ngram_continuation
from specdec.engine.cost_model import CostModel
from specdec.types import Proposal, SamplingParams


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance of one source, with a prior worth `prior_weight` observations."""

    prior: float
    prior_weight: float = 2.0
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.prior_weight) / (self.accepted + self.rejected + self.prior_weight)

    def observe(self, proposed: int, accepted: int) -> None:
        self.accepted += accepted
        self.rejected += 1 if accepted < proposed else 0


def expected_tokens(rate: float, j: int) -> float:
    """1 + a + a^2 + ... + a^j: the target's own token plus the expected accepted prefix."""
    return 1.0 + sum(rate ** i for i in range(1, j + 1))


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(
        self,
        cost_model: CostModel,
        model_drafter: Optional[ModelDrafter] = None,
        max_ngram: int = 3,
        margin: float = 0.02,
        first_probe_after: int = 8,
        ngram_prior: float = 0.5,
        draft_prior: float = 0.6,
    ):
        self.cost = cost_model
        self.model_drafter = model_drafter
        self.max_ngram = max_ngram
        self.margin = margin
        self.first_probe_after = first_probe_after
        self.priors = {"ngram": ngram_prior, "draft": draft_prior}
        self.begin(())

    def begin(self, prompt) -> None:
        self.estimates = {source: AcceptanceEstimate(prior) for source, prior in self.priors.items()}
        self.probe_interval = self.first_probe_after
        self.rounds_since_probe = 0
        # The draft model's cache is synced lazily, on its first proposal, so a request that never
        # uses it never pays for processing the prompt on it.

    # -- the policy ----------------------------------------------------------------------------
    def plan(self, ngram_available: int, k: int) -> tuple[str, int]:
        """The best (source, length) for this round: ("off", 0) when nothing beats plain decoding."""
        t1 = self.cost.target(1)
        best, best_rate = ("off", 0), 1.0 / t1
        for j in range(1, ngram_available + 1):
            rate = expected_tokens(self.estimates["ngram"].rate, j) / self.cost.target(1 + j)
            if rate > best_rate:
                best, best_rate = ("ngram", j), rate
        if self.model_drafter is not None and self.cost.draft_step_seconds:
            for j in range(1, k + 1):
                seconds = self.cost.target(1 + j) + j * self.cost.draft_step_seconds
                rate = expected_tokens(self.estimates["draft"].rate, j) / seconds
                if rate > best_rate:
                    best, best_rate = ("draft", j), rate
        if best[0] != "off" and best_rate < (1.0 + self.margin) / t1:
            return ("off", 0)
        return best

    def propose(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Proposal:
        continuation = find_ngram_continuation(context, k, self.max_ngram)
        source, j = self.plan(len(continuation), k)
        if source == "ngram":
            return Proposal(continuation[:j], None, "ngram")
        if source == "draft":
            proposal = self.model_drafter.propose(context, j, sampling, rng)
            return Proposal(proposal.draft_tokens, proposal.draft_probs, "draft")
        self.rounds_since_probe += 1
        if continuation and self.rounds_since_probe >= self.probe_interval:
            self.rounds_since_probe = 0
            return Proposal(continuation[:1], None, "ngram-probe")
        return Proposal((), None, "off")

    def observe(self, proposal: Proposal, num_accepted: int, verify_seconds: Optional[float]) -> None:
        proposed = len(proposal.draft_tokens)
        if verify_seconds is not None:
            self.cost.observe_target(1 + proposed, verify_seconds)
        if not proposed:
            return
        source = "ngram" if proposal.source.startswith("ngram") else proposal.source
        self.estimates[source].observe(proposed, num_accepted)
        if proposal.source == "ngram-probe":
            # A failed probe waits twice as long for the next; a successful one resets the wait.
            self.probe_interval = self.first_probe_after if num_accepted else self.probe_interval * 2
