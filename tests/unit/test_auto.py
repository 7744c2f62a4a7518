"""The adaptive method: decisions on a synthetic cost model and synthetic acceptance, acceptance
learned from shadow proposals, early stopping of model drafts, calibration with an injected clock,
and losslessness (greedy `auto` equals plain; sampled hybrid proposals keep the target's law)."""
import numpy as np
import pytest
from fakes.clock import FakeClock

from specdec.backends.fake import FakeBackend
from specdec.drafters.auto import (NGRAM_PRIORS, AcceptanceEstimate, AutoDrafter, EvidenceEstimate, Offer, Option,
                                   PolicyConfig, expected_tokens, match_bucket)
from specdec.backends.cost_model import CostModel
from specdec.backends.sequence import CachedSequence
from specdec.drafters.model import MAX_JOINED_CATCH_UP, Extent, ModelDrafter
from specdec.drafters.suffix import Evidence
from specdec.engine.engine import Engine
from specdec.sampling.probs import token_distribution
from specdec.sampling.verify import verify
from specdec.types import GenerationRequest, Proposal, SamplingParams, SpecConfig

GREEDY = SamplingParams()


class StubModelDrafter:
    """Stands in for a draft model: proposes `token` up to k times and records what it was asked;
    each proposal takes `seconds` (ModelDrafter.seconds)."""

    seconds = 0.0

    def __init__(self, token=7):
        self.token = token
        self.calls = []

    def propose_steps(self, context, k, sampling, rng, guide=None, *, prefix=(), keep_drafting=None):
        yield from ()
        return self.propose(context, k, sampling, rng, guide, prefix=prefix, keep_drafting=keep_drafting)

    def lag(self, context):
        return 0  # its cache always in step

    def propose(self, context, k, sampling, rng, guide=None, *, prefix=(), keep_drafting=None):
        self.calls.append((k, tuple(prefix)))
        return Proposal(tuple(prefix) + (self.token,) * (k - len(prefix)), None, "hybrid" if prefix else "draft")


def linear_costs(step=0.050, per_token=0.045, draft_step=0.02):
    return CostModel({n: step + per_token * (n - 1) for n in range(1, 9)}, draft_step)


def flat_costs(step=0.050, draft_step=0.005):
    return CostModel({n: step * (1 + 0.02 * (n - 1)) for n in range(1, 9)}, draft_step)


def drafter_with(cost, ngram_rate, draft_rate, evidence=1000, model=None):
    drafter = AutoDrafter(cost, model or StubModelDrafter())
    for source, rate in (("ngram", ngram_rate), ("cache", ngram_rate), ("draft", draft_rate), ("hybrid", draft_rate)):
        drafter.estimates[source] = AcceptanceEstimate(prior=rate, prior_weight=evidence)
    return drafter


def offers(**lengths):
    """plan()'s input: {source: an offer of that many tokens}."""
    return {source: Offer(tuple(range(100, 100 + n))) for source, n in lengths.items()}


def test_expected_tokens():
    assert expected_tokens([0.0] * 4) == 1.0
    assert expected_tokens([1.0] * 4) == 5.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tokens([0.5, 1.0]) == pytest.approx(2.0)  # positions multiply


def test_acceptance_is_estimated_per_position():
    estimate = AcceptanceEstimate(prior=0.5, prior_weight=2)
    for _ in range(20):
        estimate.observe(proposed=3, accepted=1)  # the first always accepted, the second never
    assert estimate.rate(1) > 0.9
    assert estimate.rate(2) < 0.1
    estimate.observe(proposed=3, accepted=3)
    assert len(estimate.attempts) == 3
    estimate.observe(proposed=4, accepted=2, rejected=False)  # unknown beyond two: no third attempt
    assert estimate.attempts[:3] == [22, 22, 1]


def test_picks_off_when_drafts_are_useless():
    drafter = drafter_with(linear_costs(), ngram_rate=0.2, draft_rate=0.3)
    assert drafter.plan(offers(ngram=4), k=4).source == "off"


def test_picks_off_when_verification_costs_as_much_as_the_tokens_it_could_save():
    # Near-linear verification (this CPU): even 90% acceptance does not pay for itself.
    drafter = drafter_with(linear_costs(per_token=0.048), ngram_rate=0.9, draft_rate=0.9)
    assert drafter.plan(offers(ngram=4), k=4).source == "off"


def test_picks_long_drafts_when_acceptance_is_near_one_and_verification_is_flat():
    drafter = drafter_with(flat_costs(), ngram_rate=0.98, draft_rate=0.3)
    option = drafter.plan(offers(ngram=8), k=8)
    assert (option.source, option.length) == ("ngram", 8)  # the longest proposal on offer
    drafter = drafter_with(flat_costs(), ngram_rate=0.1, draft_rate=0.97)
    option = drafter.plan({}, k=6)
    assert option.source == "draft" and option.length >= 5


def test_uses_only_what_the_ngram_match_offers_or_lets_the_draft_model_continue_it():
    drafter = drafter_with(flat_costs(), ngram_rate=0.95, draft_rate=0.0)
    option = drafter.plan(offers(ngram=2), k=8)
    assert (option.source, option.length) == ("ngram", 2)
    drafter = drafter_with(flat_costs(), ngram_rate=0.99, draft_rate=0.9)
    option = drafter.plan(offers(ngram=2), k=8)
    assert (option.source, option.prefix_source, option.prefix_length) == ("hybrid", "ngram", 2)
    assert option.length > 2


def test_exploits_an_uneven_cost_curve():
    # Two tokens cost as much as four (the shape measured on the machine): propose three.
    cost = CostModel({1: 0.117, 2: 0.157, 3: 0.155, 4: 0.152, 5: 0.2, 6: 0.246, 7: 0.27, 8: 0.289}, None)
    drafter = drafter_with(cost, ngram_rate=0.7, draft_rate=0.0)
    option = drafter.plan(offers(ngram=8), k=8)
    assert (option.source, option.length) == ("ngram", 3)


def zen5_costs(draft_step=0.013):
    """The shape of ik_llama.cpp's repacked costs on a 2-core Zen 5: a second row nearly free,
    then each row about a fifth of a step."""
    shape = (1.0, 1.02, 1.35, 1.69, 1.9, 2.1, 2.3, 2.54, 2.8)
    return CostModel({n: 0.0266 * v for n, v in enumerate(shape, start=1)}, draft_step)


def test_in_a_forward_shared_by_several_streams_rows_are_priced_at_what_they_add():
    # Alone, a prompt-lookup token accepted 40 % of the time pays for its nearly free row; in a
    # forward of four streams a row adds half of a stream's share, and plain decoding gives the
    # forward more tokens per second.
    drafter = drafter_with(zen5_costs(), ngram_rate=0.4, draft_rate=0.0)
    assert drafter.plan(offers(ngram=4), k=4).source == "ngram"
    drafter.share_round(4)
    assert drafter.plan(offers(ngram=4), k=4).source == "off"
    drafter.share_round(1)
    assert drafter.plan(offers(ngram=4), k=4).source == "ngram"


def test_a_draft_models_serial_steps_are_charged_to_the_whole_shared_forward():
    drafter = drafter_with(zen5_costs(draft_step=0.004), ngram_rate=0.0, draft_rate=0.9)
    assert drafter.plan({}, k=4).source == "draft"
    drafter.share_round(8)
    assert drafter.plan({}, k=4).source == "off"


def test_a_streams_rows_are_priced_on_top_of_the_rows_the_streams_before_it_planned():
    # A measured curve with a dip: t(8) below t(7), then a step. At 7 streams one more row looks
    # free, but only to the first stream that takes it: the next one's row would make 9.
    cost = CostModel({n: 0.050 * v for n, v in enumerate((1.0, 1.12, 1.21, 1.59, 1.47, 1.85, 2.37, 2.30, 3.09, 3.08),
                                                         start=1)}, None)
    drafter = drafter_with(cost, ngram_rate=0.3, draft_rate=0.0)
    drafter.share_round(7)
    assert drafter.plan(offers(ngram=1), k=1).source == "ngram"
    drafter.share_round(7, rows_before=1)
    assert drafter.plan(offers(ngram=1), k=1).source == "off"


def test_rounds_shared_by_several_streams_are_priced_by_what_such_forwards_took():
    # One sequence's rows nearly free (the calibration), a forward of several sequences' rows
    # dearer as measured while serving: at 4 streams a prompt-lookup row accepted 60 % of the time
    # pays on the first curve and not on the second; alone, only the first counts.
    cost = flat_costs()
    drafter = drafter_with(cost, ngram_rate=0.6, draft_rate=0.0)
    drafter.share_round(4)
    assert drafter.plan(offers(ngram=1), k=1).source == "ngram"
    for _ in range(100):
        for n in (4, 5):
            cost.observe_shared(n, 0.050 * n)
    assert cost.shared(5) == pytest.approx(0.25, rel=0.01) and cost.target(5) == pytest.approx(0.054)
    assert drafter.plan(offers(ngram=1), k=1).source == "off"
    drafter.share_round(1)
    assert drafter.plan(offers(ngram=1), k=1).source == "ngram"


def test_draft_forwards_shared_with_other_streams_are_priced_at_their_share():
    # At two streams a draft model accepted 90 % of the time does not pay at 4 ms a step run
    # alone; with its forwards shared by the other stream's proposal, each pays d(2) / 2 of a
    # step, and it does.
    drafter = drafter_with(zen5_costs(draft_step=0.004), ngram_rate=0.0, draft_rate=0.9)
    drafter.share_round(2)
    assert drafter.plan({}, k=4).source == "off"
    drafter.share_round(2, draft_sharers=2)
    assert drafter.plan({}, k=4).source == "draft"
    assert drafter.round_costs().draft_step == pytest.approx(0.004 * 1.02 / 2)


def share_rounds(n_requests, max_tokens, **request_options):
    """(streams, tokens_left) of every share_round call while the engine core runs `n_requests`
    requests at once on the fake backend, each slot's `auto` recording them."""
    seen = []

    class Recording(AutoDrafter):
        def share_round(self, streams, tokens_left=None, draft_sharers=1, rows_before=0):
            seen.append((streams, tokens_left))
            super().share_round(streams, tokens_left, draft_sharers, rows_before)

    engine = Engine(FakeBackend(seed=3), n_slots=n_requests)
    for slot in engine.slots:
        slot.drafters["auto"] = Recording(linear_costs())
    engine.cost_model = linear_costs()
    core = engine.core
    request = GenerationRequest(tuple(engine.encode_prompt([{"role": "user", "content": "a b c"}], chat=True)),
                                max_tokens, SamplingParams(), SpecConfig("auto", 3), **request_options)
    for _ in range(n_requests):
        core.add(request)
    while core.busy:
        core.step()
    return seen


def test_the_engine_core_tells_each_stream_how_many_share_its_forward():
    seen = [streams for streams, _ in share_rounds(3, 6)]
    assert 3 in seen and set(seen) <= {1, 2, 3}


def test_learns_ngram_acceptance_from_shadow_proposals_without_proposing():
    drafter = AutoDrafter(linear_costs(per_token=0.05), None)
    text = [1, 2, 3, 4] * 12  # perfectly repetitive: every continuation is right
    for end in range(8, len(text)):
        proposal = drafter.propose(text[:end], 4, GREEDY, None)
        assert proposal.draft_tokens == ()  # linear verification: plain decoding always wins
        drafter.observe(proposal, 0, None)
    # single 7-9-token matches (the first rounds) and long unanimous ones learned, above their priors
    estimate = drafter.estimates["ngram"]
    assert estimate.rate_of(Evidence(8, 1, 1)) > 0.9 > NGRAM_PRIORS[(9, "single")]
    assert estimate.rate_of(Evidence(20, 3, 3)) > 0.995 > NGRAM_PRIORS[(10**9, "unanimous")]
    assert estimate.rate_of(Evidence(1, 1, 3)) == NGRAM_PRIORS[(1, "split")]  # never seen: the prior


def path(match_length, length=4, support=1, occurrences=1):
    """The evidence of a continuation of `length` tokens after a `match_length`-token match."""
    return tuple(Evidence(match_length + i, support, occurrences) for i in range(length))


def test_evidence_estimate_on_hand_worked_cases():
    assert [match_bucket(m) for m in (1, 2, 5, 6, 7, 13, 14, 500)] == [1, 2, 6, 6, 9, 13, 10**9, 10**9]
    estimate = EvidenceEstimate(NGRAM_PRIORS, prior_weight=4.0)
    evidence = path(2, 3)
    assert estimate.rates(3, evidence) == [NGRAM_PRIORS[(2, "single")], NGRAM_PRIORS[(3, "single")],
                                          NGRAM_PRIORS[(4, "single")]]
    # after a 2-token match: position 1 accepted, position 2 rejected, position 3 never reached
    estimate.observe(proposed=3, accepted=1, rejected=True, evidence=evidence)
    assert estimate.rate_of(evidence[0]) == pytest.approx((1 + NGRAM_PRIORS[(2, "single")] * 4) / 5)
    assert estimate.rate_of(evidence[1]) == pytest.approx((0 + NGRAM_PRIORS[(3, "single")] * 4) / 5)
    assert estimate.rate_of(evidence[2]) == NGRAM_PRIORS[(4, "single")]
    assert EvidenceEstimate({}).rate_of(evidence[0]) == 0.0  # no prior for that evidence: not trusted yet


def test_prompt_lookup_is_proposed_where_its_evidence_says_it_pays():
    # ik_llama.cpp's costs on a 2-core Zen 4 (t(1) 44.5 ms, v(2) 1.42, v(3) 1.63, v(4) 1.90, v(5) 2.34):
    # one token pays from acceptance 0.42. After a 1-token match whose earlier occurrences disagree
    # (0.14) nothing is proposed. After a 1-token match all three occurrences agree on (0.56):
    # one token 1.56 / 1.42 = 1.10x plain, two (0.72 next) 1.96 / 1.63 = 1.20x, three (0.75)
    # 2.27 / 1.90 = 1.19x: two. After a single 2-token match: one 1.54 / 1.42 = 1.08x, two (0.62)
    # 1.87 / 1.63 = 1.15x, three (0.77) 2.13 / 1.90 = 1.12x: two. A 14-token match (0.98): all four.
    t1 = 0.0445
    cost = CostModel({1: t1, 2: 1.42 * t1, 3: 1.63 * t1, 4: 1.90 * t1, 5: 2.34 * t1}, None)
    drafter = AutoDrafter(cost, None)
    tokens = tuple(range(4))
    assert drafter.plan({"ngram": Offer(tokens, path(1, support=1, occurrences=3))}, k=4).source == "off"
    for evidence, length in ((path(1, support=3, occurrences=3), 2), (path(2), 2), (path(14), 4)):
        option = drafter.plan({"ngram": Offer(tokens, evidence)}, k=4)
        assert (option.source, option.length) == ("ngram", length)


def test_prices_but_never_probes_a_draft_model_that_its_acceptance_says_loses():
    hopeless = AutoDrafter(linear_costs(per_token=0.05, draft_step=0.02), StubModelDrafter())
    promising_but_unproven = drafter_with(flat_costs(), ngram_rate=0.0, draft_rate=0.01)
    for drafter in (hopeless, promising_but_unproven):
        sources = []
        for _ in range(40):
            proposal = drafter.propose([1, 2, 3], 4, GREEDY, None)
            sources.append(proposal.source)
            drafter.observe(proposal, 0, None)
        assert set(sources) == {"off"}
    assert AutoDrafter(flat_costs(), StubModelDrafter()).propose([1, 2, 3], 4, GREEDY, None).source == "draft"


def test_model_draft_stops_early_when_its_confidence_no_longer_pays():
    target = FakeBackend(seed=7)
    draft = FakeBackend(seed=7, noise=0.3)
    forwards = []
    evaluate = draft.eval
    draft.eval = lambda seq_id, start, tokens, prefill=False: forwards.append(len(tokens)) or \
        evaluate(seq_id, start, tokens, prefill=prefill)
    drafter = ModelDrafter(CachedSequence(draft, 0))
    context = target.tokenize("the cat sat on the mat", add_special=False)
    full = drafter.propose(context, 6, GREEDY, None)
    # (what keep_drafting answers at positions 0, 1, ...) -> tokens proposed, draft forwards run
    for extents, tokens, expected_forwards in (((Extent.STOP,), 0, 1), ((Extent.LAST,), 1, 1),
                                                ((Extent.MORE, Extent.STOP), 1, 2),
                                                ((Extent.MORE, Extent.MORE, Extent.LAST), 3, 3)):
        asked = []
        forwards.clear()

        def keep_drafting(position, confidence):
            asked.append(confidence)
            return extents[position]

        stopped = drafter.propose(context, 6, GREEDY, None, keep_drafting=keep_drafting)
        assert stopped.draft_tokens == full.draft_tokens[:tokens]
        assert len(asked) == len(extents) and all(0.0 < c <= 1.0 for c in asked)
        assert len(forwards) == expected_forwards  # LAST proposes its token without running the draft further

    # The policy's threshold: near-free verification keeps drafting, costly verification stops.
    for cost, expected in ((flat_costs(draft_step=0.001), Extent.MORE), (linear_costs(per_token=0.05), Extent.STOP)):
        auto = AutoDrafter(cost, drafter)
        keep = auto.draft_length(Option("draft", 6, 1.0 / cost.target(1)))
        assert keep(1, 0.9) is expected


def test_the_draft_step_already_paid_is_not_charged_to_its_token():
    """Rows of 5 ms, a draft step of 30 ms, t(1) 50 ms, a plan of 20 tok/s, draft acceptance 0.8:
    a token the draft is 40 % sure of pays its 5 ms row (0.4 > 20 x 0.005 = 0.1), so it is
    proposed, but a further draft step does not pay (0.4 x 0.8 = 0.32 < 20 x 0.035 = 0.7); a
    token it is 95 % sure of is worth drafting past (0.76 > 0.7)."""
    cost = CostModel({n: 0.050 + 0.005 * (n - 1) for n in range(1, 9)}, 0.030)
    auto = drafter_with(cost, ngram_rate=0.0, draft_rate=0.8)
    keep = auto.draft_length(Option("draft", 4, 20.0))
    assert keep(0, 0.4) is Extent.LAST and keep.forwards == 1 and keep.confidences == [0.4]
    keep = auto.draft_length(Option("draft", 4, 20.0))
    assert keep(0, 0.95) is Extent.MORE and keep.forwards == 2
    assert keep(1, 0.05) is Extent.STOP  # 0.95 x 0.05 < 0.1: not even its row
    assert keep.confidences == [0.95]  # a token left out is not calibrated against
    keep = auto.draft_length(Option("draft", 1, 20.0))
    assert keep(0, 0.95) is Extent.LAST  # a one-token plan never runs the draft further


def test_model_draft_catches_up_in_the_forward_that_starts_it():
    """After the first proposal (the prompt processed in batches), a round evaluates what was
    committed since together with the last token, then one forward per further drafted token; a
    lag past MAX_JOINED_CATCH_UP is processed as a prompt first. The proposal is what a drafter
    starting from scratch proposes."""
    draft = FakeBackend(seed=7, noise=0.3)
    calls = []
    evaluate = draft.eval
    draft.eval = lambda seq_id, start, tokens, prefill=False: calls.append((len(tokens), prefill)) or \
        evaluate(seq_id, start, tokens, prefill=prefill)
    drafter = ModelDrafter(CachedSequence(draft, 0))
    context = draft.tokenize("the cat sat on the mat and then the dog", add_special=False)
    drafter.propose(context, 2, GREEDY, None)
    for committed in ([5, 6], [7], list(range(8, 30))):
        context = context + committed
        calls.clear()
        lag = drafter.lag(context)  # what the proposal catches up on, asked without a forward (calls below)
        proposal = drafter.propose(context, 2, GREEDY, None)
        if lag <= MAX_JOINED_CATCH_UP:
            assert calls == [(lag + 1, False), (1, False)]
        else:
            assert calls == [(lag, True), (1, False), (1, False)]
        fresh = ModelDrafter(CachedSequence(FakeBackend(seed=7, noise=0.3), 0))
        assert proposal.draft_tokens == fresh.propose(context, 2, GREEDY, None).draft_tokens


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
        engine.reset_cross_request_state()
        auto = engine.generate(GenerationRequest(ids, 60, spec=SpecConfig("auto", 6)))
        assert auto.token_ids == plain.token_ids
        assert sum(auto.stats["choices"].values()) == auto.stats["draft_rounds"] + auto.stats["choices"].get("none", 0)
        assert any(choice.startswith(("draft", "ngram", "hybrid")) for choice in auto.stats["choices"])
        sources = auto.stats["sources"]  # each source's share of the rounds, drafted and accepted tokens
        assert set(sources) == {choice.split(":")[0] for choice in auto.stats["choices"] if choice != "none"}
        for key, total in (("rounds", "draft_rounds"), ("drafted", "drafted_tokens"), ("accepted", "accepted_tokens")):
            assert sum(source[key] for source in sources.values()) == auto.stats[total]
    assert engine.cost_model.target(1) == pytest.approx(0.0505)


def test_auto_falls_back_to_plain_decoding_when_verification_is_linear():
    clock = FakeClock()
    target = FakeBackend(seed=7, clock=clock, step_cost=0.0, token_cost=0.050)
    draft = FakeBackend(seed=7, noise=1.5, clock=clock, step_cost=0.0, token_cost=0.02)
    engine = Engine(target, draft, clock=clock)
    ids = tuple(engine.encode_prompt("the cat sat on the mat", chat=True))
    result = engine.generate(GenerationRequest(ids, 60, spec=SpecConfig("auto", 4)))
    assert result.stats["choices"] == {"none": result.stats["generated_tokens"]}


def test_hybrid_proposals_keep_the_target_distribution_when_sampling():
    """An n-gram prefix (one-hot q) continued by sampled draft tokens (their own q): the first
    output token must follow the target's distribution (Monte Carlo over many seeds)."""
    target = FakeBackend(seed=7)
    draft = FakeBackend(seed=7, noise=1.0)
    sampling = SamplingParams(temperature=1.0)
    context = target.tokenize("the cat sat on the mat", add_special=False)
    target_seq = CachedSequence(target, 0)
    drafter = ModelDrafter(CachedSequence(draft, 0))
    prefix = (context[-2],)  # any fixed token works as a deterministic prefix
    logits = target_seq.extend(context)[-1]
    p_first = token_distribution(logits, sampling)
    counts = np.zeros(target.vocab_size)
    rng = np.random.default_rng(0)
    trials = 3000
    for _ in range(trials):
        proposal = drafter.propose(context, 3, sampling, rng, prefix=prefix)
        assert proposal.source == "hybrid" and proposal.draft_probs.shape[0] == 3
        target_seq.truncate(len(context))
        rows = target_seq.extend(list(proposal.draft_tokens))
        target_probs = np.stack([p_first] + [token_distribution(r, sampling) for r in rows])
        verdict = verify(proposal.draft_tokens, proposal.draft_probs, target_probs, rng)
        first = verdict.accepted_tokens[0] if verdict.accepted_tokens else verdict.next_token
        counts[first] += 1
        target_seq.truncate(len(context))
    empirical = counts / trials
    # The L1 distance a sample of this size from p_first itself would show, on average.
    noise = np.sqrt(2 * p_first * (1 - p_first) / (np.pi * trials)).sum()
    assert np.abs(empirical - p_first).sum() < 1.5 * noise


def test_a_slower_step_rescales_the_whole_cost_curve():
    # Long contexts make every forward dearer; observed one-token steps must not make the rarely
    # observed multi-token forwards look relatively cheaper (v(n) would drift low).
    cost = CostModel({1: 0.05, 2: 0.095, 4: 0.18}, draft_step_seconds=0.03, draft_prefill_seconds=0.01)
    for _ in range(30):
        cost.observe_target(1, 0.10)
    assert cost.target(1) == pytest.approx(0.10, rel=0.05)
    assert cost.relative(2) == pytest.approx(1.9) and cost.relative(4) == pytest.approx(3.6)
    assert cost.draft_step_seconds / cost.target(1) == pytest.approx(0.6)
    assert cost.draft_prefill_seconds / cost.target(1) == pytest.approx(0.2)


class LaggingModelDrafter(StubModelDrafter):
    """A draft model whose cache holds only the first `held` tokens of any context."""

    def __init__(self, held):
        super().__init__()
        self.held = held

    def lag(self, context):
        return len(context) - 1 - min(self.held, len(context) - 1)


def test_the_draft_models_catch_up_is_priced():
    # Flat verification and a good draft: worth drafting when its cache is in step, but not when
    # it would first have to process a long prompt at 10 ms a token.
    context = list(range(1000))
    for held, expect_draft in ((999, True), (0, False)):
        model = LaggingModelDrafter(held)
        cost = CostModel({n: 0.050 * (1 + 0.02 * (n - 1)) for n in range(1, 9)}, 0.005, 0.010)
        drafter = drafter_with(cost, ngram_rate=0.0, draft_rate=0.9, model=model)
        proposal = drafter.propose(context, 4, GREEDY, None)
        assert (proposal.source == "draft") is expect_draft


def test_a_backlog_left_by_rounds_without_the_draft_is_an_investment_but_a_rounds_own_catch_up_is_not():
    """t(n) = 50 ms x (1 + 0.4 (n - 1)), a 10 ms draft step (its forward of n tokens 10 ms x v(n)),
    one drafted token, plain 20 tok/s (20.4 with the margin). Acceptance 0.9: 1.9 tokens for t(2) 70
    ms + draft(2) 14 ms with the one token a draft round leaves; a backlog of 5 (rounds without the
    draft) would cost draft(6) 30 ms in full (1.9 / 100 ms: 19 tok/s, never drafted again) but is
    charged 14 + 16 / 32 ms: drafted. Acceptance 0.66: 1.66 / 80 ms = 20.75 pays with the cache in
    step, 1.66 / 84 ms = 19.8 does not once the round's own token is charged."""
    context = list(range(1000))
    cost = CostModel({n: 0.050 * (1 + 0.4 * (n - 1)) for n in range(1, 9)}, 0.010, 0.010)
    for lag, draft_rate, expect_draft in ((5, 0.9, True), (0, 0.66, True), (1, 0.66, False)):
        model = LaggingModelDrafter(len(context) - 1 - lag)
        drafter = drafter_with(cost, ngram_rate=0.0, draft_rate=draft_rate, model=model)
        proposal = drafter.propose(context, 1, GREEDY, None)
        assert (proposal.source == "draft") is expect_draft, (lag, draft_rate)


def test_a_backlog_is_spread_over_no_more_rounds_than_tokens_are_left():
    """The backlog of 5 above, acceptance 0.9: spread over 32 rounds it is drafted; with 2 tokens
    left it is charged 14 + 16 / 2 ms (1.9 / 92 ms: 20.7 tok/s, plain 20.4 with the margin) and
    still drafted; with 1 left, in full (1.9 / 100 ms): not."""
    context = list(range(1000))
    cost = CostModel({n: 0.050 * (1 + 0.4 * (n - 1)) for n in range(1, 9)}, 0.010, 0.010)
    for tokens_left, expect_draft in ((None, True), (2, True), (1, False)):
        drafter = drafter_with(cost, ngram_rate=0.0, draft_rate=0.9, model=LaggingModelDrafter(len(context) - 6))
        drafter.share_round(1, tokens_left=tokens_left)
        proposal = drafter.propose(context, 1, GREEDY, None)
        assert (proposal.source == "draft") is expect_draft, tokens_left


def test_each_round_tells_the_drafter_how_many_tokens_are_left():
    rounds = [left for _, left in share_rounds(1, 5, ignore_eos=True) if left is not None]
    assert rounds[0] == 5 and rounds == sorted(rounds, reverse=True) and rounds[-1] >= 1


def test_a_draft_forward_costs_its_step_on_the_targets_curve():
    cost = CostModel({1: 0.050, 2: 0.060, 4: 0.080}, 0.010)
    assert cost.draft(1) == pytest.approx(0.010)
    assert cost.draft(2) == pytest.approx(0.012)
    assert cost.draft(3) == pytest.approx(0.014)  # between known sizes: the curve's extrapolation
    assert CostModel({1: 0.050}).draft(3) == 0.0  # no draft model


class PrefillRecordingDrafter(StubModelDrafter):
    """A draft model whose cache holds the first `held` tokens of any context until it processes a
    prompt; records what it processed."""

    def __init__(self, held=0):
        super().__init__()
        self.held = held
        self.prefilled = []

    def lag(self, context):
        return len(context) - 1 - min(self.held, len(context) - 1)

    def prefill(self, prompt_prefix):
        self.prefilled.append(tuple(prompt_prefix))
        self.held = len(prompt_prefix)


def first_two_rounds(drafter, model, prompt):
    """What the draft model processed by the round of the first token, and by the next round's."""
    drafter.begin(prompt)
    first = drafter.propose(prompt, 4, GREEDY, None)
    assert first.draft_tokens == () and model.calls == []  # the first token waits for no drafting
    by_first = list(model.prefilled)
    drafter.observe(first, 0, None)
    drafter.propose([*prompt, 5], 4, GREEDY, None)
    return by_first, list(model.prefilled)


def test_a_short_prompt_is_processed_on_the_draft_model_after_the_first_token_a_long_one_lazily():
    """12 target steps of 50 ms = 600 ms: at 5 ms a token the draft processes a 100-token prompt
    right after the first token; a 200-token one (1 s) waits for the draft's first proposal, and a
    draft model that cannot pay at all (a 60 ms step) processes nothing. What the draft's cache
    kept of an earlier turn counts out: 200 tokens of which it holds 150 are 50 to process; a lag
    a proposal's first forward takes along (here 10) is left to it."""
    for prompt_tokens, held, draft_step, eager in ((100, 0, 0.005, True), (200, 0, 0.005, False),
                                                   (100, 0, 0.060, False), (200, 150, 0.005, True),
                                                   (200, 190, 0.005, False)):
        model = PrefillRecordingDrafter(held)
        cost = CostModel({n: 0.050 * (1 + 0.02 * (n - 1)) for n in range(1, 9)}, draft_step, 0.005)
        prompt = list(range(prompt_tokens))
        by_first, by_second = first_two_rounds(AutoDrafter(cost, model), model, prompt)
        assert by_first == [], (prompt_tokens, held, draft_step)
        assert by_second == ([tuple(prompt)] if eager else []), (prompt_tokens, held, draft_step)


def test_the_draft_processes_no_prompt_where_it_pays_only_if_always_accepted():
    """Mainline-like costs (a second and third row for nearly a step each, v(3) measured a little
    below v(2)): a draft at 0.45 of a step would beat plain decoding only if every token held, so a
    short prompt is left for its first proposal, which never comes at the prior acceptance (0.78)."""
    cost = CostModel({1: 0.085, 2: 0.164, 3: 0.158, 4: 0.304, 5: 0.334}, 0.038, 0.005)
    model = PrefillRecordingDrafter()
    drafter = AutoDrafter(cost, model)
    config = PolicyConfig()
    assert drafter.draft_could_pay(config.eager_draft_k)  # (1 + 2) / (0.158 + 2 * 0.038) beats 1 / 0.085
    assert not drafter.draft_could_pay(config.eager_draft_k, config.draft_prior)
    assert first_two_rounds(drafter, model, list(range(60))) == ([], [])


class SlowModelDrafter(StubModelDrafter):
    """A draft model whose every proposal takes `seconds` on the injected clock."""

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def propose(self, context, k, sampling, rng, guide=None, *, prefix=(), keep_drafting=None):
        self.clock.advance(self.seconds)
        return super().propose(context, k, sampling, rng, guide, prefix=prefix, keep_drafting=keep_drafting)


def test_a_draft_model_slower_than_its_calibrated_step_is_priced_at_what_it_really_takes():
    """Flat verification (t(1) 50 ms, t(2) 51 ms), a 5 ms calibrated draft step and acceptance 0.3
    make one drafted token the plan (1.3 / 56 ms beats 1 / 50 ms); when each proposal takes 60 ms
    (copies, softmax, catch-up kernels the step does not count), the measured/priced ratio climbs
    towards its 3x cap until 1.3 / (51 + 5 x scale) ms no longer pays and the draft stops; at the calibrated time it stays."""
    for seconds, keeps_drafting in ((0.060, False), (0.005, True)):
        clock = FakeClock()
        auto = AutoDrafter(flat_costs(draft_step=0.005), None, clock=clock)
        auto.model_drafter = SlowModelDrafter(clock, seconds)
        auto.estimates["draft"] = AcceptanceEstimate(prior=0.3, prior_weight=1000)
        sources = []
        for _ in range(30):
            proposal = auto.propose([1, 2, 3], 1, GREEDY, None)
            sources.append(proposal.source)
            auto.observe(proposal, 0, None)
        assert sources[0] == "draft"
        assert (sources[-1] == "draft") is keeps_drafting
        if keeps_drafting:
            assert auto.draft_seconds_scale == pytest.approx(1.0)
        else:  # learned until the price stopped paying: no more proposals, no more measurements
            assert 2.0 < auto.draft_seconds_scale <= 3.0


def test_the_tunables_come_from_one_config_and_the_constructors_keywords_still_set_them():
    cost = flat_costs()
    assert AutoDrafter(cost).config == PolicyConfig()
    auto = AutoDrafter(cost, None, 8, 0.1, 0.5)  # max_ngram, margin, draft_prior, positionally as before
    assert (auto.config.max_match, auto.config.margin, auto.config.draft_prior) == (8, 0.1, 0.5)
    assert auto.margin == 0.1 and auto.estimates["draft"].prior == 0.5 and auto.context_index.max_match == 8
    config = PolicyConfig(margin=0.3, draft_prior_weight=2.0, catch_up_horizon=4)
    auto = AutoDrafter(cost, StubModelDrafter(), config=config)
    assert auto.config == config and auto.estimates["hybrid"].prior_weight == 2.0
    assert AutoDrafter(cost, config=config, margin=0.05).config == PolicyConfig(margin=0.05, draft_prior_weight=2.0,
                                                                                catch_up_horizon=4)
    with pytest.raises(ValueError):
        PolicyConfig(draft_scale_range=(2.0, 1.0))


def test_the_first_token_waits_for_no_drafting():
    """Issue 43: `auto`'s first token comes at `off`'s time. Between admission and the first token
    the draft model runs no forward (its prompt is processed after it) and the first round
    verifies the pending token alone, as `off`'s does; the draft catches up and drafts afterwards,
    and the text is `off`'s."""
    clock = FakeClock()
    target = FakeBackend(seed=7, clock=clock, step_cost=0.050, token_cost=0.0005)
    draft = FakeBackend(seed=7, noise=0.3, clock=clock, step_cost=0.002)
    engine = Engine(target, draft, clock=clock)
    engine.calibrate()
    ids = tuple(engine.encode_prompt("the cat sat on the mat", chat=True))
    plain = engine.generate(GenerationRequest(ids, 40, spec=SpecConfig("off", 0)))
    engine.reset_cross_request_state()
    engine.clear_cache()
    draft.eval_calls.clear()
    target.eval_calls.clear()
    events = engine.stream(GenerationRequest(ids, 40, spec=SpecConfig("auto", 6)))
    first = next(events)
    assert first.token_ids == plain.token_ids[:1]
    assert draft.eval_calls == []  # nothing on the draft model before the first token
    assert target.eval_calls[-1] == (0, 1)  # the first round: the pending token alone
    events = [first, *events]
    assert [t for event in events for t in event.token_ids] == plain.token_ids
    stats = events[-1].stats
    assert stats["ttft_seconds"] == pytest.approx(plain.stats["ttft_seconds"])
    assert draft.eval_calls and any(choice.startswith(("draft", "hybrid")) for choice in stats["choices"])
