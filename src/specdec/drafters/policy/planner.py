"""Each round's choice: of every proposal on offer, the one with the most expected tokens per second,
or plain decoding unless something beats it by the margin. Pure: no state, no I/O.

The options are a draft-free source's offer cut to 1..k tokens ("ngram": the request's own text,
"cache": the tenant's earlier requests), the draft model drafting 1..k tokens ("draft"), and the
draft model continuing the first m tokens of a draft-free offer ("hybrid"). The draft model is
priced only where it could beat plain decoding with every token accepted, so it is never probed
where its price says it loses (notebook, "the draft model pays").

Example: t(1) = 50 ms, t(2) = 96 ms, t(4) = 180 ms, n-gram acceptance 0.9 at every position: one
token 1.9 / 96 ms = 19.8 tok/s, three tokens 3.44 / 180 ms = 19.1 tok/s, plain 20 tok/s -> plain
decoding. With t(2) = 63 ms and a single 2-token match (0.54): 1.54 / 63 ms = 24.4 tok/s -> one token.

How far a planned model draft then goes is decided token by token from its confidence (DraftLength).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from specdec.drafters.model import Extent
from specdec.drafters.policy.config import PolicyConfig
from specdec.drafters.policy.estimates import Estimate
from specdec.drafters.policy.pricing import RoundCosts, best_uniform_proposal, cumulative_expected_tokens
from specdec.drafters.suffix import Continuation

Offer = Continuation  # what a draft-free source offers this round, with each token's evidence


@dataclass(frozen=True)
class Option:
    source: str  # "off", "ngram", "cache", "draft" or "hybrid"
    length: int  # tokens proposed
    tokens_per_second: float
    prefix_source: str = ""  # hybrid: the draft-free source whose offer the draft model continues
    prefix_length: int = 0


def draft_could_pay(costs: RoundCosts, k: int, margin: float, acceptance: float = 1.0) -> bool:
    """Whether the draft model beats plain decoding by the margin with its tokens accepted at this
    rate (by default always: whether it can pay at all)."""
    if costs.draft_step is None:
        return False
    _, best = best_uniform_proposal(acceptance, k, costs.target, costs.draft_step)
    return best > (1.0 + margin) / costs.target(1)


def options(offers: Mapping[str, Offer], estimates: Mapping[str, Estimate], costs: RoundCosts,
            config: PolicyConfig, k: int) -> list[Option]:
    """Every proposal of up to k tokens worth pricing, plain decoding first. Called every round:
    kept cheap."""
    target = [costs.target(n) for n in range(1, k + 2)]  # target[n - 1]: n rows
    priced = [Option("off", 0, 1.0 / target[0])]
    source_rates = {source: estimates[source].rates(len(offer.tokens[:k]), offer.evidence)
                    for source, offer in offers.items()}
    for source, rates in source_rates.items():
        for j, tokens in enumerate(cumulative_expected_tokens(rates)[1:], start=1):
            priced.append(Option(source, j, tokens / target[j]))
    if not draft_could_pay(costs, k, config.margin):
        return priced
    for kind, prefixes in (("draft", {"": []}), ("hybrid", source_rates)):
        model_rates = estimates[kind].rates(k)
        for prefix_source, prefix_rates in prefixes.items():
            for m in range(len(prefix_rates[:k - 1]) + 1):
                if kind == "hybrid" and m == 0:
                    continue
                yields = cumulative_expected_tokens([*prefix_rates[:m], *model_rates[:k - m]])
                for j in range(m + 1, len(yields)):
                    seconds = target[j] + costs.draft(m, j - m)
                    priced.append(Option(kind, j, yields[j] / seconds, prefix_source, m))
    return priced


def plan(offers: Mapping[str, Offer], estimates: Mapping[str, Estimate], costs: RoundCosts,
         config: PolicyConfig, k: int) -> Option:
    """The best option this round: "off" unless something beats plain decoding by the margin."""
    priced = options(offers, estimates, costs, config, k)
    plain, best = priced[0], max(priced, key=lambda o: o.tokens_per_second)
    if best.tokens_per_second < (1.0 + config.margin) * plain.tokens_per_second:
        return plain
    return best


def draft_extent(reach: float, confidence: float, calibration: float, tokens_per_second: float,
                 row: float, next_rate: float | None, next_cost: float) -> tuple[Extent, float]:
    """(how far the draft goes at this position, the chance every token through it is accepted).

    The step that produced this position is paid, so its token is proposed while its chance of
    acceptance (`reach` before it times its calibrated confidence) pays for its verification `row`
    at the planned rate; the draft runs for the next position only while that position's expected
    acceptance (`next_rate`, None past the plan) also pays for `next_cost`, a draft step and its
    row. Charging the paid step again left most draft rounds proposing nothing (notebook, "the
    draft model pays")."""
    reach_with = reach * min(1.0, confidence * calibration)
    if reach_with < tokens_per_second * row:
        return Extent.STOP, reach
    if next_rate is None or reach_with * next_rate < tokens_per_second * next_cost:
        return Extent.LAST, reach_with
    return Extent.MORE, reach_with


@dataclass
class DraftLength:
    """keep_drafting(position, confidence) for one planned model proposal (drafters/model.py's
    KeepDrafting), recording what the proposal's price and the confidence calibration need: the
    confidences of the tokens it let through and the draft forwards run."""

    option: Option
    reach: float  # the chance every token before the next one is accepted
    calibration: float  # accepted / confidence, so far (estimates.ConfidenceCalibration)
    model_rates: Sequence[float]
    costs: RoundCosts
    confidences: list[float] = field(default_factory=list)
    forwards: int = 1  # the one over the last token (and prefix), whose logits give the first

    @classmethod
    def for_option(cls, option: Option, offers: Mapping[str, Offer], estimates: Mapping[str, Estimate],
             costs: RoundCosts, calibration: float) -> "DraftLength":
        reach = 1.0
        if option.prefix_length:
            for rate in estimates[option.prefix_source].rates(option.prefix_length,
                                                              offers[option.prefix_source].evidence):
                reach *= rate
        model_rates = estimates[option.source].rates(option.length - option.prefix_length)
        return cls(option, reach, calibration, model_rates, costs)

    def __call__(self, position: int, confidence: float) -> Extent:
        further = position + 1 - self.option.prefix_length  # the next model token's index in model_rates
        draft_step = self.costs.draft_step or 0.0
        extent, reach = draft_extent(
            self.reach, confidence, self.calibration, self.option.tokens_per_second, self.costs.row(position),
            self.model_rates[further] if further < len(self.model_rates) else None,
            draft_step + self.costs.row(position + 1))
        if extent is not Extent.STOP:
            self.confidences.append(confidence)
            self.reach = reach
        if extent is Extent.MORE:
            self.forwards += 1
        return extent
