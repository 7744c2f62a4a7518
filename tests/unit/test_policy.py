"""The adaptive policy's parts on their own (drafters/policy/): the pure planner, table-driven (which
option it picks for given offers, acceptance and costs), the pricing, the estimates and the priors file."""
import copy
import json
from importlib import resources

import pytest

from specdec.drafters.model import Extent
from specdec.drafters.policy import priors
from specdec.drafters.policy.config import PolicyConfig
from specdec.drafters.policy.estimates import (AcceptanceEstimate, ConfidenceCalibration, DraftTimeScale,
                                               EvidenceEstimate, Shadow, score_shadows)
from specdec.drafters.policy.planner import DraftLength, Offer, Option, draft_could_pay, draft_extent, options, plan
from specdec.drafters.policy.pricing import (RoundCosts, best_uniform_proposal, cumulative_expected_tokens,
                                             expected_tokens)
from specdec.backends.cost_model import CostModel
from specdec.drafters.suffix import Evidence


def linear(step=0.050, per_token=0.045, draft_step=0.02):
    return CostModel({n: step + per_token * (n - 1) for n in range(1, 9)}, draft_step)


def flat(step=0.050, draft_step=0.005, draft_prefill=None):
    return CostModel({n: step * (1 + 0.02 * (n - 1)) for n in range(1, 9)}, draft_step, draft_prefill)


def uneven():
    """Two tokens cost as much as four (measured on the first issue's machine); no draft model."""
    return CostModel({1: 0.117, 2: 0.157, 3: 0.155, 4: 0.152, 5: 0.2, 6: 0.246, 7: 0.27, 8: 0.289}, None)


def zen5(draft_step=0.013):
    shape = (1.0, 1.02, 1.35, 1.69, 1.9, 2.1, 2.3, 2.54, 2.8)
    return CostModel({n: 0.0266 * v for n, v in enumerate(shape, start=1)}, draft_step)


def zen4():
    """ik_llama.cpp on a 2-core Zen 4: t(1) 44.5 ms, v(2..5) 1.42 1.63 1.90 2.34; no draft model."""
    t1 = 0.0445
    return CostModel({1: t1, 2: 1.42 * t1, 3: 1.63 * t1, 4: 1.90 * t1, 5: 2.34 * t1}, None)


def fixed(ngram=0.0, cache=None, draft=0.0):
    """Acceptance at every position, as if long learned (a prior worth 1000 observations)."""
    rates = {"ngram": ngram, "cache": ngram if cache is None else cache, "draft": draft, "hybrid": draft}
    return {source: AcceptanceEstimate(rate, 1000) for source, rate in rates.items()}


def learned_from_priors():
    return {"ngram": EvidenceEstimate(priors.NGRAM_PRIORS), "cache": EvidenceEstimate(priors.CACHE_PRIORS),
            "draft": AcceptanceEstimate(0.78, 8), "hybrid": AcceptanceEstimate(0.78, 8)}


def path(match_length, length=4, support=1, occurrences=1):
    """The evidence of a continuation of `length` tokens after a `match_length`-token match."""
    return tuple(Evidence(match_length + i, support, occurrences) for i in range(length))


def offer(n, evidence=()):
    return Offer(tuple(range(100, 100 + n)), evidence)


CASES = [
    # (what it shows, cost model, streams, lag, estimates, offers, k, margin) -> (source, length, prefix)
    ("useless drafts: plain", linear(), 1, 0, fixed(0.2, draft=0.3), {"ngram": offer(4)}, 4, 0.02, ("off", 0, "")),
    ("near-linear verification: not even 0.9 pays", linear(per_token=0.048), 1, 0, fixed(0.9, draft=0.9),
     {"ngram": offer(4)}, 4, 0.02, ("off", 0, "")),
    ("flat verification, 0.98: the whole offer", flat(), 1, 0, fixed(0.98, draft=0.3), {"ngram": offer(8)}, 8, 0.02,
     ("ngram", 8, "")),
    ("flat verification, a good draft, no offer", flat(), 1, 0, fixed(0.1, draft=0.97), {}, 6, 0.02, ("draft", 6, "")),
    ("only what the match offers", flat(), 1, 0, fixed(0.95, draft=0.0), {"ngram": offer(2)}, 8, 0.02,
     ("ngram", 2, "")),
    ("the draft continues a sure match", flat(), 1, 0, fixed(0.99, draft=0.9), {"ngram": offer(2)}, 8, 0.02,
     ("hybrid", 8, "ngram")),
    ("an uneven curve: three tokens", uneven(), 1, 0, fixed(0.7), {"ngram": offer(8)}, 8, 0.02, ("ngram", 3, "")),
    ("the tenant's history where it is surer", zen5(None), 1, 0, fixed(0.3, cache=0.9),
     {"ngram": offer(4), "cache": offer(4)}, 4, 0.02, ("cache", 4, "")),
    ("a nearly free row pays at 0.4 alone", zen5(), 1, 0, fixed(0.4), {"ngram": offer(4)}, 4, 0.02, ("ngram", 1, "")),
    ("... but not in a forward of four streams", zen5(), 4, 0, fixed(0.4), {"ngram": offer(4)}, 4, 0.02,
     ("off", 0, "")),
    ("a draft alone pays", zen5(0.004), 1, 0, fixed(draft=0.9), {}, 4, 0.02, ("draft", 2, "")),
    ("... its serial steps not in a forward of eight", zen5(0.004), 8, 0, fixed(draft=0.9), {}, 4, 0.02,
     ("off", 0, "")),
    ("a draft in step pays", flat(draft_prefill=0.010), 1, 0, fixed(draft=0.9), {}, 4, 0.02, ("draft", 4, "")),
    ("... not with a 999-token prompt to catch up on", flat(draft_prefill=0.010), 1, 999, fixed(draft=0.9), {}, 4,
     0.02, ("off", 0, "")),
    ("1 % better than plain: under the margin", linear(per_token=0.0), 1, 0, fixed(0.0101), {"ngram": offer(1)}, 1,
     0.02, ("off", 0, "")),
    ("... over a margin of 0", linear(per_token=0.0), 1, 0, fixed(0.0101), {"ngram": offer(1)}, 1, 0.0,
     ("ngram", 1, "")),
    ("evidence: a split 1-token match (0.14)", zen4(), 1, 0, learned_from_priors(),
     {"ngram": offer(4, path(1, support=1, occurrences=3))}, 4, 0.02, ("off", 0, "")),
    ("evidence: a unanimous 1-token match (0.56, 0.72, ...)", zen4(), 1, 0, learned_from_priors(),
     {"ngram": offer(4, path(1, support=3, occurrences=3))}, 4, 0.02, ("ngram", 2, "")),
    ("evidence: a single 2-token match (0.54, 0.62, ...)", zen4(), 1, 0, learned_from_priors(),
     {"ngram": offer(4, path(2))}, 4, 0.02, ("ngram", 2, "")),
    ("evidence: a 14-token match (0.98)", zen4(), 1, 0, learned_from_priors(), {"ngram": offer(4, path(14))}, 4, 0.02,
     ("ngram", 4, "")),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_plan_picks(case):
    _, cost, streams, lag, estimates, offers, k, margin, expected = case
    costs = RoundCosts(cost, streams, has_draft=cost.draft_step_seconds is not None, lag=lag)
    before = copy.deepcopy(estimates)
    option = plan(offers, estimates, costs, PolicyConfig(margin=margin), k)
    assert (option.source, option.length, option.prefix_source) == expected
    assert option == plan(offers, estimates, costs, PolicyConfig(margin=margin), k)  # no state, no side effects
    assert estimates == before and cost.observations == {}


def test_without_a_draft_model_the_draft_is_never_priced():
    costs = RoundCosts(flat(), has_draft=False)
    assert not draft_could_pay(costs, 4, 0.02)
    priced = options({"ngram": offer(2)}, fixed(0.5, draft=1.0), costs, PolicyConfig(), 4)
    assert {option.source for option in priced} == {"off", "ngram"}
    assert [option.length for option in priced] == [0, 1, 2]


def test_options_price_each_proposal_at_its_expected_tokens_over_its_seconds():
    cost = CostModel({1: 0.050, 2: 0.096, 3: 0.138, 4: 0.180}, None)
    priced = options({"ngram": offer(3)}, fixed(0.9), RoundCosts(cost), PolicyConfig(), 3)
    assert [round(option.tokens_per_second, 2) for option in priced] == [20.0, 19.79, 19.64, 19.11]
    # the module's example: 1.9 / 96 ms, 3.44 / 180 ms against plain 20 tok/s -> plain
    assert plan({"ngram": offer(3)}, fixed(0.9), RoundCosts(cost), PolicyConfig(), 3).source == "off"


@pytest.mark.parametrize("reach, confidence, calibration, rate, row, next_rate, next_cost, expected", [
    # rows of 5 ms, a 30 ms draft step, 20 tok/s planned, draft acceptance 0.8
    (1.0, 0.4, 1.0, 20.0, 0.005, 0.8, 0.035, (Extent.LAST, 0.4)),  # pays its row, not a further step
    (1.0, 0.95, 1.0, 20.0, 0.005, 0.8, 0.035, (Extent.MORE, 0.95)),  # 0.76 > 0.7: drafts on
    (0.95, 0.05, 1.0, 20.0, 0.005, 0.8, 0.035, (Extent.STOP, 0.95)),  # 0.0475 < 0.1: not even its row
    (1.0, 0.95, 1.0, 20.0, 0.005, None, 0.035, (Extent.LAST, 0.95)),  # the plan's last token
    (1.0, 0.6, 2.0, 20.0, 0.005, 0.8, 0.035, (Extent.MORE, 1.0)),  # calibrated up, capped at 1
])
def test_draft_extent(reach, confidence, calibration, rate, row, next_rate, next_cost, expected):
    assert draft_extent(reach, confidence, calibration, rate, row, next_rate, next_cost) == expected


def test_draft_length_records_what_prices_and_calibrates_the_proposal():
    cost = CostModel({n: 0.050 + 0.005 * (n - 1) for n in range(1, 9)}, 0.030)
    costs = RoundCosts(cost, has_draft=True)
    keep = DraftLength.for_option(Option("draft", 4, 20.0), {}, fixed(draft=0.8), costs, calibration=1.0)
    # 0.95 x 0.8 and 0.95 x 0.99 x 0.8 beat 20 x 35 ms (a step and a row); 0.94 x 0.01 < 20 x 5 ms
    assert [keep(0, 0.95), keep(1, 0.99), keep(2, 0.01)] == [Extent.MORE, Extent.MORE, Extent.STOP]
    assert keep.confidences == [0.95, 0.99] and keep.forwards == 3
    # a hybrid starts from its prefix's chance of holding, 0.5 x 0.5: 0.25 x 0.9 pays its row, not a step
    hybrid = Option("hybrid", 4, 20.0, "ngram", 2)
    keep = DraftLength.for_option(hybrid, {"ngram": offer(2)}, fixed(0.5, draft=0.8), costs, calibration=1.0)
    assert keep.reach == 0.25 and keep(2, 0.9) is Extent.LAST


def test_pricing_is_written_once():
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75) == cumulative_expected_tokens([0.5, 0.5])[-1]
    assert cumulative_expected_tokens([]) == [1.0] and expected_tokens([1.0] * 4) == 5.0
    cost = CostModel({1: 0.050, 2: 0.060, 3: 0.070}, 0.010)
    # 1 + 0.8 = 1.8 / (60 + 10 ms) = 25.7; 1 + 0.8 + 0.64 = 2.44 / (70 + 20 ms) = 27.1
    assert best_uniform_proposal(0.8, 2, cost.target, 0.010) == (2, pytest.approx(2.44 / 0.090))
    assert best_uniform_proposal(0.8, 2, cost.target)[1] == pytest.approx(2.44 / 0.070)


def test_round_costs():
    cost = CostModel({n: 0.050 * (1 + 0.4 * (n - 1)) for n in range(1, 9)}, 0.010, 0.010)
    alone, shared = RoundCosts(cost), RoundCosts(cost, streams=4)
    assert alone.target(3) == cost.target(3)
    assert shared.target(3) == pytest.approx(cost.target(4) / 4 + cost.target(6) - cost.target(4))
    assert alone.row(0) == pytest.approx(cost.target(2) - cost.target(1))
    assert alone.draft_step is None and RoundCosts(cost, has_draft=True, draft_scale=2.0).draft_step == 0.020
    # one drafted token with a backlog of 5: its own catch-up (one token: a 2-token forward, 14 ms)
    # in full, the rest of a 6-token forward (30 ms) over 32 rounds
    backlog = RoundCosts(cost, has_draft=True, lag=5)
    assert backlog.draft_seconds(0, 1) == pytest.approx(0.030)
    assert backlog.draft(0, 1) == pytest.approx(0.014 + 0.016 / 32)
    assert RoundCosts(cost, has_draft=True, lag=5, draft_scale=2.0).draft(0, 1) == pytest.approx(2 * backlog.draft(0, 1))
    # a lag past MAX_JOINED_CATCH_UP is processed as a prompt first, then one token, one further forward
    assert RoundCosts(cost, has_draft=True, lag=100).draft_seconds(0, 2) == pytest.approx(1.0 + 0.010 + 0.010)


def test_shadows_are_judged_once_the_committed_tokens_decide_them():
    evidence = path(3, 3)
    shadows = [Shadow("ngram", 5, Offer((1, 2, 3), evidence)), Shadow("cache", 7, Offer((9,), path(4, 1)))]
    verdicts, pending = score_shadows(shadows, [0] * 5 + [1, 2])  # 1, 2 so far: undecided
    assert verdicts == [] and pending == shadows
    verdicts, pending = score_shadows(shadows, [0] * 5 + [1, 2, 4])
    assert [(v.source, v.proposed, v.accepted, v.rejected) for v in verdicts] == [("ngram", 3, 2, True),
                                                                                  ("cache", 1, 0, True)]
    assert pending == []


def test_the_draft_time_scale_is_a_seeded_clipped_median():
    scale = DraftTimeScale(window=9, prior=4, clip=(0.5, 3.0))
    scale.observe(10.0, 1.0)  # a stall: clipped to 3, outvoted by the seed
    assert scale.value == 1.0
    for _ in range(5):
        scale.observe(2.0, 1.0)
    assert scale.value == 2.0
    scale.observe(1.0, 0.0)  # nothing priced: nothing learned
    assert list(scale.ratios).count(2.0) == 5


def test_confidence_calibration_counts_verified_positions():
    calibration = ConfidenceCalibration(prior=1.0)
    calibration.observe([0.5, 0.5, 0.5], model_accepted=1)  # the first held, the second rejected, the third unseen
    assert calibration.value == pytest.approx(2.0 / 2.0)
    calibration.observe([1.0, 1.0], model_accepted=0)
    assert calibration.value == pytest.approx(2.0 / 3.0)


def test_the_priors_file_is_what_the_fit_writes(tmp_path):
    packaged = resources.files("specdec").joinpath("data").joinpath(priors.PRIORS_FILE).read_text(encoding="utf-8")
    content = priors.document(priors.NGRAM_PRIORS, priors.CACHE_PRIORS, priors.DRAFT_PRIOR)
    assert priors.dumps(content) == packaged  # the writer reproduces the file byte for byte
    assert priors.NGRAM_PRIORS[(1, "split")] == 0.14 and priors.NGRAM_PRIORS[(10**9, "unanimous")] == 0.99
    assert priors.CACHE_PRIORS[(4, "single")] == 0.31 and (1, "single") not in priors.CACHE_PRIORS
    assert priors.DRAFT_PRIOR == 0.78 == PolicyConfig().draft_prior
    refit = dict(priors.NGRAM_PRIORS)
    refit[(2, "single")] = 0.6
    written = priors.write(tmp_path / "priors.json", priors.document(refit, priors.CACHE_PRIORS, 0.8))
    loaded = priors.load(written)
    assert loaded.ngram == refit and loaded.cache == priors.CACHE_PRIORS and loaded.draft == 0.8
    broken = json.loads(packaged)
    broken["ngram"]["5"] = [0.5] * 4  # not a bucket
    with pytest.raises(ValueError):
        priors.parse(broken)


def simulate_drafting_script():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "simulate_drafting.py"
    spec = importlib.util.spec_from_file_location("simulate_drafting", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_simulate_drafting_decodes_streams_together_in_one_forward_a_round():
    """--streams: every unfinished stream's rows in one forward a round, priced at t(all rows)."""
    from specdec.drafters.base import Drafter, NoDrafter
    from specdec.types import Proposal

    simulate = simulate_drafting_script()
    cost = CostModel({n: 0.01 * (1 + n) for n in range(1, 17)}, None)  # t(n) = 10 ms x (1 + n)
    outputs = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    generations = [([1, 2], outputs[0]), ([3, 4], outputs[1])]

    class Knows(Drafter):  # proposes the next two tokens of its output: both always accepted
        def __init__(self, output):
            self.output = output

        def propose(self, context, k, sampling, rng, guide=None):
            done = len(context) - 2
            return Proposal(tuple(self.output[done:done + min(2, k)]))

    plain = simulate.simulate_together([NoDrafter(), NoDrafter()], 3, generations, cost)
    # Rounds 1-3: two rows, t(2) = 30 ms; rounds 4-6: one row, t(1) = 20 ms.
    assert plain["rounds"] == 6 and plain["seconds"] == pytest.approx(0.15) == pytest.approx(plain["plain_seconds"])
    knowing = simulate.simulate_together([Knows(outputs[0]), Knows(outputs[1])], 3, generations, cost)
    # Round 1: 3 + 3 rows (t(6) = 70 ms) commit 3 tokens each; round 2: 3 rows of the first (40 ms).
    assert (knowing["rounds"], knowing["proposed"], knowing["accepted"]) == (2, 6, 6)
    assert knowing["seconds"] == pytest.approx(0.11)


def test_simulate_drafting_fits_and_writes_the_priors_file(tmp_path):
    """scripts/simulate_drafting.py --fit-priors --write: the fit over recorded outputs becomes the
    file `auto` loads, the draft model's prior kept from the file it replaces."""
    simulate = simulate_drafting_script()
    text = [1, 2, 3, 4, 5, 1, 2, 3, 6, 7] * 3
    generations = [("qa", rank, text[:10], {"output_token_ids": text[10:]}) for rank in range(3)]
    fitted = simulate.fit_priors(generations, skip=1)
    target = tmp_path / "priors.json"
    target.write_text(priors.dumps(priors.document(priors.NGRAM_PRIORS, priors.CACHE_PRIORS, 0.7)))
    loaded = priors.load(simulate.write_priors(fitted, target))
    assert loaded.draft == 0.7
    assert loaded.ngram == {key: prior for key, (_, _, prior) in fitted["ngram"].items()} and loaded.ngram
    assert loaded.cache == {key: prior for key, (_, _, prior) in fitted["cache"].items()}
