"""The adaptive method: decisions on a synthetic cost model, calibration with an injected clock,
and losslessness (greedy `auto` equals plain)."""
import pytest

from specdec.backends.fake import FakeBackend
from specdec.drafters.auto import AcceptanceEstimate, AutoDrafter, expected_tokens
from specdec.engine.cost_model import CostModel
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SpecConfig


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class StubModelDrafter:
    """Stands in for a draft model in policy tests (the policy only needs to know one exists)."""


def linear_costs(step=0.050, per_token=0.045, draft_step=0.02):
    return CostModel({n: step + per_token * (n - 1) for n in range(1, 9)}, draft_step)


def flat_costs(step=0.050, draft_step=0.005):
    return CostModel({n: step * (1 + 0.02 * (n - 1)) for n in range(1, 9)}, draft_step)


def drafter_with(cost, ngram_rate, draft_rate, evidence=1000):
    drafter = AutoDrafter(cost, StubModelDrafter())
    for source, rate in (("ngram", ngram_rate), ("draft", draft_rate)):
        drafter.estimates[source] = AcceptanceEstimate(prior=rate, prior_weight=evidence)
    return drafter


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_picks_off_when_drafts_are_useless():
    drafter = drafter_with(linear_costs(), ngram_rate=0.2, draft_rate=0.3)
    assert drafter.plan(ngram_available=4, k=4) == ("off", 0)


def test_picks_off_when_verification_costs_as_much_as_the_tokens_it_could_save():
    # Near-linear verification (this CPU): even 90% acceptance does not pay for itself.
    drafter = drafter_with(linear_costs(per_token=0.048), ngram_rate=0.9, draft_rate=0.9)
    assert drafter.plan(ngram_available=4, k=4) == ("off", 0)


def test_picks_long_drafts_when_acceptance_is_near_one_and_verification_is_flat():
    drafter = drafter_with(flat_costs(), ngram_rate=0.98, draft_rate=0.3)
    assert drafter.plan(ngram_available=8, k=8) == ("ngram", 8)  # the longest proposal on offer
    drafter = drafter_with(flat_costs(), ngram_rate=0.1, draft_rate=0.97)
    source, length = drafter.plan(ngram_available=0, k=6)
    assert source == "draft" and length >= 5


def test_uses_only_what_the_ngram_match_offers():
    drafter = drafter_with(flat_costs(), ngram_rate=0.95, draft_rate=0.0)
    assert drafter.plan(ngram_available=2, k=8) == ("ngram", 2)


def test_probes_at_growing_intervals_while_plain_wins():
    drafter = AutoDrafter(linear_costs(per_token=0.05), None, first_probe_after=4)
    context = [1, 2, 3, 1, 2]  # an n-gram match exists
    sources = []
    for _ in range(30):
        proposal = drafter.propose(context, 4, None, None)
        sources.append(proposal.source)
        drafter.observe(proposal, 0, None)  # every probe fails
    probes = [i for i, s in enumerate(sources) if s == "ngram-probe"]
    assert probes[:3] == [3, 11, 27]  # after 4, then 8, then 16 plain rounds


def test_online_cost_updates_move_toward_observations():
    cost = linear_costs()
    before = cost.target(3)
    for _ in range(50):
        cost.observe_target(3, 0.060)
    assert before > cost.target(3) > 0.060 - 1e-3


def test_calibration_measures_the_fake_backends_costs_with_an_injected_clock():
    clock = FakeClock()
    target = FakeBackend(seed=7, clock=clock, step_cost=0.050, token_cost=0.010)
    draft = FakeBackend(seed=7, noise=0.5, clock=clock, step_cost=0.015, token_cost=0.001)
    engine = Engine(target, draft, clock=clock)
    cost = engine.calibrate()
    for n in range(1, 9):
        assert cost.target(n) == pytest.approx(0.050 + 0.010 * n)
    assert cost.draft_step_seconds == pytest.approx(0.016)
    assert engine.slots[0].target.tokens == [] and target.cached_tokens(0) == []


def test_auto_is_lossless_and_its_decisions_are_visible():
    clock = FakeClock()
    # Flat verification: auto should speculate, and still reproduce plain greedy output exactly.
    target = FakeBackend(seed=7, clock=clock, step_cost=0.050, token_cost=0.0005)
    draft = FakeBackend(seed=7, noise=0.3, clock=clock, step_cost=0.002)
    engine = Engine(target, draft, clock=clock)
    for prompt in ["the cat sat on the mat", "abc abc abc", "x"]:
        ids = tuple(engine.encode_prompt(prompt, chat=True))
        plain = engine.generate(GenerationRequest(ids, 60, spec=SpecConfig("off", 0)))
        auto = engine.generate(GenerationRequest(ids, 60, spec=SpecConfig("auto", 6)))
        assert auto.token_ids == plain.token_ids
        assert sum(auto.stats["choices"].values()) == auto.stats["draft_rounds"] + auto.stats["choices"].get("none", 0)
        assert any(choice.startswith(("draft", "ngram")) for choice in auto.stats["choices"])
    assert engine.cost_model.target(1) == pytest.approx(0.0505)


def test_auto_falls_back_to_plain_decoding_when_verification_is_linear():
    clock = FakeClock()
    target = FakeBackend(seed=7, clock=clock, step_cost=0.0, token_cost=0.050)
    draft = FakeBackend(seed=7, noise=1.5, clock=clock, step_cost=0.0, token_cost=0.02)
    engine = Engine(target, draft, clock=clock)
    ids = tuple(engine.encode_prompt("the cat sat on the mat", chat=True))
    result = engine.generate(GenerationRequest(ids, 60, spec=SpecConfig("auto", 4)))
    assert result.stats["choices"].get("none", 0) >= 0.8 * sum(result.stats["choices"].values())
