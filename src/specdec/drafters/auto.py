"""Method `auto`: before each round, propose whatever is expected to give the most tokens per
second under this machine's measured costs — a continuation from the request's own text
("ngram": prompt and output so far), one from the tenant's earlier requests ("cache"), the draft
model, a hybrid (a draft-free continuation the draft model extends), or nothing.

Acceptance is estimated online per request, per source and per position: a_i is the chance that
position i is accepted once positions 1..i-1 were. For the draft-free sources it follows each
token's own evidence (drafters/suffix.py): the length of the match behind it and whether the
earlier occurrences of that match agree on it (measured on Spec-Bench, the request's own text:
0.14 after a 1-token match whose occurrences disagree, 0.56 after one on which they all agree,
0.54 after a single 2-token match, 0.98 after 14+; NGRAM_PRIORS). Accepting the tokens before
position i lengthens its match, which its evidence already counts. So the policy knows per
proposal when, and how far, copying pays. A proposal of j tokens is then expected to yield
E(j) = 1 + a_1 + a_1 a_2 + ... + a_1...a_j tokens (the target's own token included) for a cost of
t(1 + j) target seconds (plus j draft-model steps for the draft model). Plain decoding yields one
token for t(1). The policy takes the best option, and only speculates when it beats plain decoding
by a margin.

The draft-free sources are learned for free: every round, what they would have proposed is compared
with the tokens the target then commits (a "shadow" proposal), so the policy knows how good they
are without paying to verify them. The draft model is priced from its measured acceptance (its
prior) and what it achieved in this request, and at what its proposals really take: each one is
timed against the forwards and catch-up it was priced at (logits copies, softmax and the
catch-up's own kernel are not in the calibrated step), and that ratio scales its price from then
on; it is not probed where that price says it loses
(probing it on a 2-core CPU cost more than it found). Once the plan picks the draft model, how far
it drafts (up to k) is decided token by token from the draft's own confidence, calibrated against
what the target accepted: a token the draft has produced is proposed while its chance of being
accepted pays for its verification row at the planned rate, and the draft runs for the next
position only while that position's expected acceptance also pays for a draft step. The step
already run is not charged again (charging it left most draft rounds on a Zen 3 proposing nothing
after paying for the step).

It only changes what is proposed, never what is accepted: every decision depends on the context
and earlier outcomes, never on the token being drawn, so the acceptance rule stays exact.

Example: t(1) = 50 ms, t(2) = 96 ms, t(4) = 180 ms, n-gram acceptance 0.9 at every position:
one token E = 1.9 / 96 ms = 19.8 tok/s, three tokens E = 3.44 / 180 ms = 19.1 tok/s, plain
20 tok/s -> plain decoding. With t(2) = 63 ms and a single 2-token match (0.54): 1.54 / 63 ms =
24.4 tok/s -> propose one token.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from specdec.drafters.base import Drafter
from specdec.drafters.history import TenantHistory
from specdec.drafters.model import MAX_JOINED_CATCH_UP, Extent, ModelDrafter
from specdec.drafters.suffix import Continuation, Evidence, SuffixIndex
from specdec.engine.cost_model import CostModel
from specdec.types import Proposal, SamplingParams

NGRAM_SOURCES = ("ngram", "cache")  # deterministic sources, learned from shadow proposals
CATCH_UP_HORIZON = 32  # rounds over which the draft model's backlog (the prompt, at first) is priced
MAX_MATCH = 16  # the longest match prompt lookup looks for (matches of 14+ are accepted 98 % of the time)
# draft_seconds_scale is the median of the last DRAFT_SCALE_WINDOW proposals' measured/priced
# seconds: a moving average let one stalled proposal (3x) price the draft out for many rounds.
DRAFT_SCALE_WINDOW = 9
# The window starts with this many ratios of 1 (the calibrated price): otherwise one stalled first
# proposal (a warm-up's, say) sets the scale alone, at its cap the draft is priced out of every
# later request, and, never proposed again, it is never measured again (a Spec-Bench run on a Zen 3
# whose `auto` used the draft in no round at all).
DRAFT_SCALE_PRIOR = 4
DRAFT_SCALE_RANGE = (0.5, 3.0)  # one observation's ratio is clipped to this: a stall must not ban the model
# Observations the draft model's prior acceptance is worth in a request. Its acceptance is a
# property of the model pair (0.6-0.95 per Spec-Bench category); with 2, one early rejection
# priced it below plain decoding and, never tried again, it was never relearned.
DRAFT_PRIOR_WEIGHT = 8.0
# A prompt the draft model processes for at most this many target steps is processed with the
# target's, before the first token, when the draft model pays at its prior acceptance: a chat
# prompt (40-140 tokens, 0.2-0.7 s on a Zen 3) whose answer the draft drafts anyway. Processed
# lazily instead, on the first draft round, it is paid inside decoding, and a short answer (8-30
# tokens) lost 10-20 % of its speed to it. A longer prompt (a document, where copying is what
# pays) stays lazy: it is paid only if the draft is used.
EAGER_DRAFT_PROMPT_STEPS = 12.0
EAGER_DRAFT_K = 4  # the proposal lengths over which begin() asks whether the draft could pay


@dataclass
class AcceptanceEstimate:
    """Per-position acceptance of one source. Position i's estimate starts from position i-1's
    (the first from `prior`), worth `prior_weight` observations."""

    prior: float
    prior_weight: float = 2.0
    attempts: list[float] = field(default_factory=list)
    accepts: list[float] = field(default_factory=list)

    def rate(self, position: int) -> float:
        """a_position (1-based)."""
        return self.rates(position)[-1] if position > 0 else self.prior

    def rates(self, length: int, evidence: Sequence[Evidence] = ()) -> list[float]:
        """[a_1, ..., a_length], in one pass: each position's estimate is the prior of the next.
        (`evidence` is EvidenceEstimate's; positions alone say it all here.)"""
        rates, rate = [], self.prior
        for i in range(length):
            if i < len(self.attempts):
                rate = (self.accepts[i] + rate * self.prior_weight) / (self.attempts[i] + self.prior_weight)
            rates.append(rate)
        return rates

    def observe(self, proposed: int, accepted: int, rejected: bool = True, evidence: Sequence[Evidence] = ()) -> None:
        """`accepted` leading positions were accepted; if `rejected`, position accepted + 1 was not
        (False when the outcome past the accepted ones is unknown)."""
        reached = min(proposed, accepted + (1 if rejected else 0))
        while len(self.attempts) < reached:
            self.attempts.append(0.0)
            self.accepts.append(0.0)
        for i in range(reached):
            self.attempts[i] += 1
            self.accepts[i] += 1 if i < accepted else 0


# P(a draft-free source's next token is accepted | its evidence), by the match length's bucket
# (m = 1, 2, 3, 4, 5-6, 7-9, 10-13, 14+, keyed by each bucket's longest m) and whether the earlier
# occurrences agree on the token (drafters/suffix.py), fit on Spec-Bench prompts 6-15 of each
# category (greedy outputs of the default pair on ik_llama.cpp, 128 tokens; prompts 1-5, the
# benchmark's, left out): `scripts/simulate_drafting.py --fit-priors`. "ngram" is the request's
# own context, "cache" the tenant's earlier requests (the earlier fit prompts).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 13, 10**9)
AGREEMENTS = ("single", "unanimous", "majority", "split")


def by_evidence(rows: dict[int, tuple[float, ...]]) -> dict[tuple[int, str], float]:
    """{bucket: (rate if single, unanimous, majority, split)} -> {(bucket, agreement): rate}."""
    return {(bucket, agreement): rate for bucket, rates in rows.items() for agreement, rate in zip(AGREEMENTS, rates)}


# bucket: single, unanimous, majority, split
NGRAM_PRIORS = by_evidence({
    1: (0.24, 0.56, 0.31, 0.14),
    2: (0.54, 0.72, 0.5, 0.2),
    3: (0.62, 0.75, 0.54, 0.25),
    4: (0.77, 0.8, 0.57, 0.55),
    6: (0.76, 0.76, 0.72, 0.39),
    9: (0.84, 0.81, 0.83, 0.72),
    13: (0.91, 0.91, 0.91, 0.91),
    10**9: (0.98, 0.99, 0.98, 0.9),
})
CACHE_PRIORS = by_evidence({
    4: (0.31, 0.43, 0.29, 0.2),
    6: (0.43, 0.63, 0.35, 0.24),
    9: (0.62, 0.79, 0.58, 0.33),
    13: (0.75, 0.77, 0.62, 0.49),
    10**9: (0.62, 0.62, 0.62, 0.62),
})


def match_bucket(match_length: int) -> int:
    """The MATCH_BUCKETS bound whose bucket holds this match length."""
    return next(bound for bound in MATCH_BUCKETS if max(1, match_length) <= bound)


def evidence_key(evidence: Evidence) -> tuple[int, str]:
    return match_bucket(evidence.match_length), evidence.agreement


@dataclass
class EvidenceEstimate:
    """Per-request acceptance of a draft-free source by each token's evidence: each cell starts
    from its prior, worth `prior_weight` observations, and learns from this request's outcomes.
    Example: a token after a 2-token match on which all earlier occurrences agree is priced at
    priors[(2, "unanimous")] until this request has tried some."""

    priors: dict
    prior_weight: float = 4.0
    attempts: dict = field(default_factory=dict)
    accepts: dict = field(default_factory=dict)

    def rate_of(self, evidence: Evidence) -> float:
        key = evidence_key(evidence)
        prior = self.priors.get(key, 0.0)  # evidence never fit (no prior): trust only what it shows here
        return (self.accepts.get(key, 0.0) + prior * self.prior_weight) / \
            (self.attempts.get(key, 0.0) + self.prior_weight)

    def rates(self, length: int, evidence: Sequence[Evidence] = ()) -> list[float]:
        return [self.rate_of(e) for e in evidence[:length]]

    def observe(self, proposed: int, accepted: int, rejected: bool = True, evidence: Sequence[Evidence] = ()) -> None:
        for i in range(min(proposed, accepted + (1 if rejected else 0))):
            key = evidence_key(evidence[i])
            self.attempts[key] = self.attempts.get(key, 0.0) + 1
            self.accepts[key] = self.accepts.get(key, 0.0) + (1 if i < accepted else 0)


def expected_tokens(rates: Sequence[float]) -> float:
    """1 + a1 + a1 a2 + ...: the target's own token plus the expected accepted prefix."""
    total, reach = 1.0, 1.0
    for rate in rates:
        reach *= rate
        total += reach
    return total


@dataclass(frozen=True)
class Option:
    source: str  # "off", "ngram", "cache", "draft" or "hybrid"
    length: int  # tokens proposed
    tokens_per_second: float
    prefix_source: str = ""  # hybrid: the n-gram source whose match the draft model continues
    prefix_length: int = 0


Offer = Continuation  # what a draft-free source offers this round, with each token's evidence


@dataclass
class _Shadow:
    """What an n-gram source would have proposed at a context length, checked once committed."""

    source: str
    context_length: int
    offer: Offer


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(
        self,
        cost_model: CostModel,
        model_drafter: Optional[ModelDrafter] = None,
        max_ngram: int = MAX_MATCH,
        margin: float = 0.02,
        draft_prior: float = 0.78,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.cost = cost_model
        self.model_drafter = model_drafter
        self.margin = margin
        self.clock = clock
        # What a draft-model proposal really takes over what its calibrated step and catch-up
        # price it at (its logits copied out, softmax, the catch-up's own kernel): measured per
        # proposal, kept across requests (a property of the machine), and applied to its price.
        self.draft_seconds_scale = 1.0
        self._draft_seconds_ratios: deque[float] = deque([1.0] * DRAFT_SCALE_PRIOR, maxlen=DRAFT_SCALE_WINDOW)
        self.priors = {"draft": draft_prior, "hybrid": draft_prior}
        self.context_index = SuffixIndex(max_ngram)
        self.streams = 1  # streams sharing the coming verification forward (share_round)
        self.begin(())

    def begin(self, prompt, history: Optional[TenantHistory] = None) -> None:
        self.history = history
        self.context_index.reset()
        self.estimates = {"ngram": EvidenceEstimate(NGRAM_PRIORS), "cache": EvidenceEstimate(CACHE_PRIORS),
                          **{source: AcceptanceEstimate(prior, DRAFT_PRIOR_WEIGHT) for source, prior in self.priors.items()}}
        self.shadows: list[_Shadow] = []
        self.confidence_sum = 1.0  # calibration of the draft's confidence: accepted / confidence
        self.confidence_accepted = 1.0
        self._last: Optional[Option] = None
        self._offers: dict[str, Offer] = {}
        self._confidences: list[float] = []
        self.draft_forwards = 0  # forwards the last model proposal made (_early_stop counts them)
        self._context: Sequence[int] = ()
        if prompt and self._draft_prompt_is_cheap(prompt):
            self.model_drafter.begin(prompt)
        # Otherwise the draft model's cache is synced lazily, on its first proposal, so a request
        # that never uses it never pays for processing the prompt on it.

    # -- the policy ----------------------------------------------------------------------------
    def share_round(self, streams: int) -> None:
        self.streams = max(1, streams)

    def target_seconds(self, rows: int) -> float:
        """What a round of `rows` rows of this stream costs it. Alone: t(rows). In a forward shared
        by N streams (each assumed to bring one row): its share of the plain round, t(N) / N, plus
        what its further rows add, t(N + rows - 1) - t(N); an option then beats plain decoding
        exactly when it raises the whole forward's tokens per second. Priced as if alone, four
        streams on a Zen 5 decoded slower with auto than with off."""
        if self.streams == 1:
            return self.cost.target(rows)
        shared = self.cost.target(self.streams)
        return shared / self.streams + self.cost.target(self.streams + rows - 1) - shared

    def options(self, available: dict[str, Offer], k: int) -> list[Option]:
        """Every proposal worth pricing, with its expected tokens per second; `available` holds
        what each n-gram source offers this round. Called every round: kept cheap."""
        target = [self.target_seconds(n) for n in range(1, k + 2)]  # target[n - 1]: n rows
        options = [Option("off", 0, 1.0 / target[0])]
        source_rates = {source: self.estimates[source].rates(len(offer.tokens[:k]), offer.evidence)
                        for source, offer in available.items()}
        for source, rates in source_rates.items():
            reach = tokens = 1.0
            for j, rate in enumerate(rates, start=1):
                reach *= rate
                tokens += reach
                options.append(Option(source, j, tokens / target[j]))
        if not self.draft_could_pay(k):
            return options
        lag = self._draft_lag()
        for kind, prefixes in (("draft", {"": []}), ("hybrid", source_rates)):
            model_rates = self.estimates[kind].rates(k)
            for prefix_source, prefix_rates in prefixes.items():
                for m in range(len(prefix_rates[:k - 1]) + 1):
                    if kind == "hybrid" and m == 0:
                        continue
                    reach, tokens = 1.0, 1.0
                    for rate in prefix_rates[:m]:
                        reach *= rate
                        tokens += reach
                    for j, rate in enumerate(model_rates[:k - m], start=m + 1):
                        reach *= rate
                        tokens += reach
                        seconds = target[j] + self._draft_price(lag, m, j - m) * self.draft_seconds_scale
                        options.append(Option(kind, j, tokens / seconds, prefix_source, m))
        return options

    def plan(self, available: dict[str, Offer], k: int) -> Option:
        """The best option this round: "off" unless something beats plain decoding by the margin."""
        options = self.options(available, k)
        plain, best = options[0], max(options, key=lambda o: o.tokens_per_second)
        if best.tokens_per_second < (1.0 + self.margin) * plain.tokens_per_second:
            return plain
        return best

    def draft_could_pay(self, k: int, acceptance: float = 1.0) -> bool:
        """Whether the draft model beats plain decoding here with its tokens accepted at this rate
        (by default always: whether it can pay at all)."""
        if self.model_drafter is None or not self.cost.draft_step_seconds:
            return False
        draft_step = self.cost.draft_step_seconds * self.draft_seconds_scale
        best = max(expected_tokens([acceptance] * j) / (self.target_seconds(1 + j) + j * draft_step)
                   for j in range(1, k + 1))
        return best > (1.0 + self.margin) / self.target_seconds(1)

    def _draft_prompt_is_cheap(self, prompt: Sequence[int]) -> bool:
        """Whether the draft model processes this prompt with the target's (EAGER_DRAFT_PROMPT_STEPS):
        only where it pays at its prior acceptance. "Could pay if always accepted" let one noisy
        calibration of mainline llama.cpp on a Zen 3 (v(3) measured below v(2)) process every short
        prompt on a draft that then proposed in no round: 0.5-0.8 s more to the first token."""
        if not self.draft_could_pay(EAGER_DRAFT_K, self.priors["draft"]):
            return False
        return self.cost.draft_prompt(len(prompt)) <= EAGER_DRAFT_PROMPT_STEPS * self.cost.target(1)

    # -- rounds --------------------------------------------------------------------------------
    def propose(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator, guide=None) -> Proposal:
        self._context = context
        self._learn_from_shadows(context)
        self.context_index.track(context)
        offers = {"ngram": self.context_index.continuation(context, k)}
        if self.history is not None:
            offers["cache"] = self.history.continuation(context, k)
        if guide is not None:  # priced as the grammar leaves them
            cut = {source: guide.admissible(offer.tokens) for source, offer in offers.items()}
            offers = {source: replace(offer, tokens=offer.tokens[:cut[source]], evidence=offer.evidence[:cut[source]])
                      for source, offer in offers.items()}
        offers = {source: offer for source, offer in offers.items() if offer.tokens}
        option = self.plan(offers, k)
        self._last = option
        self._offers = offers
        for source, offer in offers.items():
            if source not in (option.source, option.prefix_source):  # those learn from the verdict
                self.shadows.append(_Shadow(source, len(context), offer))
        if option.source in NGRAM_SOURCES:
            return Proposal(offers[option.source].tokens[:option.length], None, option.source)
        if option.source in ("draft", "hybrid"):
            # The plan says the draft pays; how far it goes is then decided token by token from its
            # confidence (_early_stop), up to k: each further step is priced as it comes.
            option = self._last = replace(option, length=k)
            self._confidences = []
            prefix = offers[option.prefix_source].tokens[:option.prefix_length] if option.prefix_length else ()
            lag = self._draft_lag()
            started = self.clock()
            proposal = self.model_drafter.propose(context, option.length, sampling, rng, prefix,
                                                  self._early_stop(option), guide=guide)
            self._observe_draft_seconds(self.clock() - started,
                                        self._draft_seconds(lag, len(prefix), self.draft_forwards))
            return Proposal(proposal.draft_tokens, proposal.draft_probs, option.source)
        return Proposal((), None, "off")

    def observe(self, proposal: Proposal, num_accepted: int, verify_seconds: Optional[float]) -> None:
        proposed = len(proposal.draft_tokens)
        if verify_seconds is not None:
            self.cost.observe_target(1 + proposed, verify_seconds)
        option, self._last = self._last, None
        if not proposed or option is None:
            return
        rejected = num_accepted < proposed
        if proposal.source in NGRAM_SOURCES:
            evidence = self._offers[proposal.source].evidence
            self.estimates[proposal.source].observe(proposed, num_accepted, rejected, evidence)
            return
        prefix = option.prefix_length if proposal.source == "hybrid" else 0
        if prefix:
            self.estimates[option.prefix_source].observe(prefix, min(num_accepted, prefix), num_accepted < prefix,
                                                         self._offers[option.prefix_source].evidence)
        if num_accepted >= prefix:
            model_accepted = num_accepted - prefix
            self.estimates["hybrid" if prefix else "draft"].observe(proposed - prefix, model_accepted, rejected)
            self._calibrate_confidence(model_accepted)

    # -- helpers -------------------------------------------------------------------------------
    def _learn_from_shadows(self, context: Sequence[int]) -> None:
        """Score earlier shadow proposals against the tokens committed since."""
        pending = []
        for shadow in self.shadows:
            committed = context[shadow.context_length:]
            tokens = shadow.offer.tokens
            matched = 0
            for proposed, actual in zip(tokens, committed):
                if proposed != actual:
                    break
                matched += 1
            if matched == len(tokens) or matched < len(committed):
                self.estimates[shadow.source].observe(len(tokens), matched, matched < len(tokens),
                                                      shadow.offer.evidence)
            else:
                pending.append(shadow)  # every committed token matched, more are needed to judge it
        self.shadows = pending

    def _draft_seconds(self, lag: int, prefix: int, forwards: int) -> float:
        """Calibrated seconds of a draft-model proposal: its first forward evaluates the committed
        tokens its cache lacks (`lag`), the last one and the n-gram `prefix` together (a longer lag
        than MAX_JOINED_CATCH_UP is processed as a prompt first), every later forward one token."""
        catch_up = 0.0
        if lag > MAX_JOINED_CATCH_UP:
            catch_up, lag = self.cost.draft_prompt(lag), 0
        return catch_up + self.cost.draft(lag + 1 + prefix) + (forwards - 1) * (self.cost.draft_step_seconds or 0.0)

    def _draft_price(self, lag: int, prefix: int, forwards: int) -> float:
        """What a round is charged for a draft-model proposal: the catch-up a draft round leaves
        for the next one (at most one token, its last accepted draft) in full; a longer lag (the
        prompt on first use, or what rounds without the draft committed) must be processed before
        any later draft round too, so it is an investment spread over CATCH_UP_HORIZON rounds.
        Charged in full, it priced the draft out after a few rounds without it, and every further
        round without it made it dearer: on a Zen 3, an mt_bench answer left the draft unused for
        its last 90 tokens, where the fixed draft ran 1.15x."""
        own = self._draft_seconds(min(lag, 1), prefix, forwards)
        return own + (self._draft_seconds(lag, prefix, forwards) - own) / CATCH_UP_HORIZON

    def _draft_lag(self) -> int:
        """The committed tokens the draft's cache lacks."""
        sequence = getattr(self.model_drafter, "sequence", None)
        if sequence is None or not self._context:
            return 0
        return len(self._context) - 1 - sequence.reusable_prefix(self._context[:-1])

    def _observe_draft_seconds(self, measured: float, priced: float) -> None:
        if priced <= 0:
            return
        low, high = DRAFT_SCALE_RANGE
        self._draft_seconds_ratios.append(min(high, max(low, measured / priced)))
        self.draft_seconds_scale = statistics.median(self._draft_seconds_ratios)

    def _early_stop(self, option: Option):
        """keep_drafting(position, confidence) for the draft model. The draft step that gave this
        position is paid, so its token is proposed while the chance that it is accepted (its
        prefix included) pays for its verification row at the planned rate; the draft runs for the
        next position only while that position's expected acceptance also pays for a draft step
        and a row. Stopping when the row alone did not pay for the draft step too left the step
        wasted: most of `auto`'s draft rounds on a Zen 3 proposed nothing. Also counts the draft
        forwards made, which price the proposal (`draft_forwards`)."""
        reach = 1.0  # chance that every token before the next one is accepted
        if option.prefix_length:
            for rate in self.estimates[option.prefix_source].rates(option.prefix_length,
                                                                   self._offers[option.prefix_source].evidence):
                reach *= rate
        calibration = self.confidence_accepted / self.confidence_sum
        draft_step = (self.cost.draft_step_seconds or 0.0) * self.draft_seconds_scale
        model_rates = self.estimates[option.source].rates(option.length - option.prefix_length)
        self.draft_forwards = 1  # the one over the last token (and prefix): its logits give the first

        def row(position: int) -> float:
            """Seconds of verifying the proposal's token at `position` (0-based)."""
            return self.target_seconds(position + 2) - self.target_seconds(position + 1)

        def keep_drafting(position: int, confidence: float) -> Extent:
            nonlocal reach
            reach_with = reach * min(1.0, confidence * calibration)
            if reach_with < option.tokens_per_second * row(position):
                return Extent.STOP
            self._confidences.append(confidence)
            reach = reach_with
            further = position + 1 - option.prefix_length  # the next model token's index in model_rates
            if further >= len(model_rates) or \
                    reach * model_rates[further] < option.tokens_per_second * (draft_step + row(position + 1)):
                return Extent.LAST
            self.draft_forwards += 1
            return Extent.MORE

        return keep_drafting

    def _calibrate_confidence(self, model_accepted: int) -> None:
        """Compare the draft's confidence with what the target accepted, over verified positions."""
        for position, confidence in enumerate(self._confidences[:model_accepted + 1]):
            self.confidence_sum += confidence
            self.confidence_accepted += 1 if position < model_accepted else 0
