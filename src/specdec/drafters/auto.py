"""Method `auto`: before each round, propose whatever is expected to give the most tokens per second
under this machine's measured costs: a continuation of the request's own text ("ngram"), of the
tenant's earlier requests ("cache"), the draft model's, a hybrid (the draft model extending a
draft-free continuation), or nothing.

This module is the drafter the engine drives; the policy lives in drafters/policy/: what is learned
(estimates.py), the fitted priors (priors.py, data/drafting_priors.json), the pricing (pricing.py),
each round's choice (planner.py) and the tunables (config.py). The draft-free sources are learned
for free: what they would have proposed is scored against what the target then commits (shadows).

Exact by construction: every decision depends on the context and earlier outcomes, never on the
token being drawn, so it changes what is proposed, never what is accepted (docs/exactness.md).
The measurements behind the design are in docs/notebook.md and docs/results.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np

from specdec.drafters.base import Drafter, DraftSteps, run_alone
from specdec.drafters.history import TenantHistory
from specdec.drafters.model import MAX_JOINED_CATCH_UP, ModelDrafter
from specdec.drafters.policy import planner
from specdec.drafters.policy.config import MAX_MATCH, PolicyConfig
from specdec.drafters.policy.estimates import (AcceptanceEstimate, ConfidenceCalibration, DraftTimeScale, Estimate,
                                               EvidenceEstimate, Shadow, score_shadows)
from specdec.drafters.policy.planner import DraftLength, Offer, Option
from specdec.drafters.policy.pricing import RoundCosts, expected_tokens
from specdec.drafters.policy.priors import (AGREEMENTS, CACHE_PRIORS, MATCH_BUCKETS, NGRAM_PRIORS, by_evidence,
                                            evidence_key, match_bucket)
from specdec.backends.cost_model import CostModel
from specdec.drafters.registry import DRAFT_FREE, MODEL_SOURCES  # the proposal sources auto offers
from specdec.drafters.suffix import SuffixIndex
from specdec.types import Proposal, SamplingParams

__all__ = ["AGREEMENTS", "CACHE_PRIORS", "MATCH_BUCKETS", "MAX_MATCH", "NGRAM_PRIORS", "NGRAM_SOURCES",
           "AcceptanceEstimate", "AutoDrafter", "EvidenceEstimate", "Offer", "Option", "PolicyConfig",
           "by_evidence", "evidence_key", "expected_tokens", "match_bucket"]

NGRAM_SOURCES = DRAFT_FREE


@dataclass
class _Round:
    """The round proposed and not yet observed: its plan, the offers it was chosen from, and the
    confidences of the model tokens it proposed."""

    option: Option
    offers: dict[str, Offer]
    confidences: list[float] = field(default_factory=list)


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(
        self,
        cost_model: CostModel,
        model_drafter: Optional[ModelDrafter] = None,
        max_ngram: Optional[int] = None,
        margin: Optional[float] = None,
        draft_prior: Optional[float] = None,
        clock: Callable[[], float] = time.perf_counter,
        config: Optional[PolicyConfig] = None,
    ):
        """`max_ngram`, `margin` and `draft_prior`, where given, override `config`'s."""
        config = config or PolicyConfig()
        overrides: dict[str, Any] = {"max_match": max_ngram, "margin": margin, "draft_prior": draft_prior}
        self.config = replace(config, **{name: value for name, value in overrides.items() if value is not None})
        self.cost = cost_model
        self.model_drafter = model_drafter
        self.clock = clock
        self.draft_time = DraftTimeScale(self.config.draft_scale_window, self.config.draft_scale_prior,
                                         self.config.draft_scale_range)  # kept across requests: the machine's
        self.context_index = SuffixIndex(self.config.max_match)
        self.streams = 1  # streams sharing the coming verification forward (share_round)
        self.tokens_left: Optional[int] = None  # at most this many more tokens (share_round)
        self.draft_sharers = 1  # streams sharing a model proposal's draft forwards (share_round)
        self.rows_before = 0  # extra rows the streams planned before this one put in the forward (share_round)
        self.begin(())

    @property
    def margin(self) -> float:
        return self.config.margin

    @property
    def draft_seconds_scale(self) -> float:
        return self.draft_time.value

    def begin(self, prompt, history: Optional[TenantHistory] = None) -> None:
        config = self.config
        self.history = history
        self.context_index.reset()
        self.estimates: dict[str, Estimate] = {
            "ngram": EvidenceEstimate(NGRAM_PRIORS, config.evidence_prior_weight),
            "cache": EvidenceEstimate(CACHE_PRIORS, config.evidence_prior_weight),
            **{source: AcceptanceEstimate(config.draft_prior, config.draft_prior_weight) for source in MODEL_SOURCES}}
        self.shadows: list[Shadow] = []
        self.confidence = ConfidenceCalibration(config.confidence_prior)
        self._round: Optional[_Round] = None
        self._context: Sequence[int] = ()
        # Nothing is drafted, indexed or looked up before the first token: it comes at plain
        # decoding's time, and the draft processes the prompt after it (_catch_up).
        self._prompt_length = len(prompt)
        self._catch_up_due = bool(prompt) and self.model_drafter is not None

    def share_round(self, streams: int, tokens_left: Optional[int] = None, draft_sharers: int = 1,
                    rows_before: int = 0) -> None:
        self.streams = max(1, streams)
        self.tokens_left = tokens_left
        self.draft_sharers = max(1, draft_sharers)
        self.rows_before = max(0, rows_before)

    # -- pricing and planning (drafters/policy/) -------------------------------------------------
    def round_costs(self, lag: int = 0) -> RoundCosts:
        """This round's prices; `lag`: committed tokens the draft model's cache lacks."""
        # A backlog is spread over the rounds still to come, and a round yields a token at least.
        horizon = self.config.catch_up_horizon
        if self.tokens_left is not None:
            horizon = max(1, min(horizon, self.tokens_left))
        return RoundCosts(self.cost, self.streams, self.model_drafter is not None, self.draft_time.value, lag, horizon,
                          self.draft_sharers, self.rows_before)

    def target_seconds(self, rows: int) -> float:
        """What a round of `rows` rows costs this stream (RoundCosts.target)."""
        return self.round_costs().target(rows)

    def draft_could_pay(self, k: int, acceptance: float = 1.0) -> bool:
        return planner.draft_could_pay(self.round_costs(), k, self.config.margin, acceptance)

    def _costs_for(self, k: int) -> RoundCosts:
        costs = self.round_costs()
        if planner.draft_could_pay(costs, k, self.config.margin):  # the lag scans the draft's cache: only where priced
            costs = replace(costs, lag=self._draft_lag())
        return costs

    def options(self, available: dict[str, Offer], k: int) -> list[Option]:
        return planner.options(available, self.estimates, self._costs_for(k), self.config, k)

    def plan(self, available: dict[str, Offer], k: int) -> Option:
        return planner.plan(available, self.estimates, self._costs_for(k), self.config, k)

    def draft_length(self, option: Option, offers: Optional[dict[str, Offer]] = None,
                     costs: Optional[RoundCosts] = None) -> DraftLength:
        """keep_drafting for a model proposal of this plan (planner.DraftLength)."""
        return DraftLength.for_option(option, offers or {}, self.estimates, costs or self.round_costs(),
                                      self.confidence.value)

    def _catch_up(self, context: Sequence[int]) -> None:
        """Once the first token is out: the draft processes what it lacks of the context (the prompt,
        less what its cache kept of an earlier turn) now, where that takes at most
        `eager_draft_prompt_steps` target steps and the draft pays at its prior acceptance
        (notebook, "the draft's prompt with the target's"). A longer backlog (a document) waits for
        the draft's first proposal, whose price spreads it over the rounds to come
        (RoundCosts.draft): a request that never drafts never pays for it. A backlog a proposal's
        first forward takes along (MAX_JOINED_CATCH_UP) is left to it."""
        assert self.model_drafter is not None  # due only with one
        lag = self.model_drafter.lag(context)
        if lag <= MAX_JOINED_CATCH_UP or not self.draft_could_pay(self.config.eager_draft_k, self.config.draft_prior):
            return
        if self.cost.draft_prompt(lag) <= self.config.eager_draft_prompt_steps * self.cost.target(1):
            self.model_drafter.prefill(context[:-1])

    def _draft_lag(self) -> int:
        return self.model_drafter.lag(self._context) if self.model_drafter is not None else 0

    # -- rounds ----------------------------------------------------------------------------------
    def propose(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator, guide=None) -> Proposal:
        return run_alone(self.propose_steps(context, k, sampling, rng, guide), self.clock)

    def propose_steps(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator,
                      guide=None) -> DraftSteps:
        if len(context) <= self._prompt_length:
            # The round of the first token verifies the pending token alone, as plain decoding's: the
            # first token waits for no drafting, indexing or lookup (issue 43).
            return Proposal((), None, "off")
        if self._catch_up_due:
            self._catch_up_due = False
            self._catch_up(context)
        self._context = context
        self._learn_from_shadows(context)
        self.context_index.track(context)
        offers = self._offers(context, k, guide)
        costs = self._costs_for(k)
        option = planner.plan(offers, self.estimates, costs, self.config, k)
        self._round = _Round(option, offers)
        for source, offer in offers.items():
            if source not in (option.source, option.prefix_source):  # those learn from the verdict
                self.shadows.append(Shadow(source, len(context), offer))
        if option.source in DRAFT_FREE:
            return Proposal(offers[option.source].tokens[:option.length], None, option.source)
        if option.source in MODEL_SOURCES and self.model_drafter is not None:  # priced only with one
            # The plan says the draft pays; how far it goes, up to k, is decided token by token.
            option = replace(option, length=k)
            keep_drafting = self.draft_length(option, offers, costs)
            self._round = _Round(option, offers, keep_drafting.confidences)
            prefix = offers[option.prefix_source].tokens[:option.prefix_length] if option.prefix_length else ()
            proposal = yield from self.model_drafter.propose_steps(context, option.length, sampling, rng, guide,
                                                                   prefix=prefix, keep_drafting=keep_drafting)
            self.draft_time.observe(self.model_drafter.seconds, costs.draft_seconds(len(prefix), keep_drafting.forwards))
            return Proposal(proposal.draft_tokens, proposal.draft_probs, option.source)
        return Proposal((), None, "off")

    def _offers(self, context, k: int, guide) -> dict[str, Offer]:
        """What each draft-free source offers this round, cut where the grammar forbids a token."""
        offers = {"ngram": self.context_index.continuation(context, k)}
        if self.history is not None:
            offers["cache"] = self.history.continuation(context, k)
        if guide is not None:
            cut = {source: guide.admissible(offer.tokens) for source, offer in offers.items()}
            offers = {source: replace(offer, tokens=offer.tokens[:cut[source]], evidence=offer.evidence[:cut[source]])
                      for source, offer in offers.items()}
        return {source: offer for source, offer in offers.items() if offer.tokens}

    def observe(self, proposal: Proposal, num_accepted: int, verify_seconds: Optional[float]) -> None:
        proposed = len(proposal.draft_tokens)
        if verify_seconds is not None:
            self.cost.observe_target(1 + proposed, verify_seconds)
        round_, self._round = self._round, None
        if not proposed or round_ is None:
            return
        option, offers = round_.option, round_.offers
        rejected = num_accepted < proposed
        if proposal.source in DRAFT_FREE:
            self.estimates[proposal.source].observe(proposed, num_accepted, rejected, offers[proposal.source].evidence)
            return
        prefix = option.prefix_length if proposal.source == "hybrid" else 0
        if prefix:
            self.estimates[option.prefix_source].observe(prefix, min(num_accepted, prefix), num_accepted < prefix,
                                                         offers[option.prefix_source].evidence)
        if num_accepted >= prefix:
            model_accepted = num_accepted - prefix
            self.estimates["hybrid" if prefix else "draft"].observe(proposed - prefix, model_accepted, rejected)
            self.confidence.observe(round_.confidences, model_accepted)

    def _learn_from_shadows(self, context: Sequence[int]) -> None:
        verdicts, self.shadows = score_shadows(self.shadows, context)
        for verdict in verdicts:
            self.estimates[verdict.source].observe(verdict.proposed, verdict.accepted, verdict.rejected,
                                                   verdict.evidence)
