"""The decoding loop on the weightless fake backend: speculative greedy == plain greedy, caches in
step after every round, stops honoured, text streamed in whole characters."""
import pytest

from fakes.clock import FakeClock

from specdec.backends.cost_model import CostModel
from specdec.backends.fake import FakeBackend
from specdec.engine.core import Started
from specdec.engine.decoder import Generation
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SamplingParams, SpecConfig, SpecdecError, StreamEvent


def make_engine(noise=0.6, **target_kwargs):
    return Engine(FakeBackend(seed=7, **target_kwargs), FakeBackend(seed=7, noise=noise, **target_kwargs))


def request(engine, prompt="the cat sat on the mat", method="off", k=4, max_tokens=60, **kw):
    sampling = kw.pop("sampling", SamplingParams())
    return GenerationRequest(
        tuple(engine.encode_prompt(prompt, chat=True)), max_tokens, sampling, SpecConfig(method, k), **kw
    )


PROMPTS = ["the cat sat on the mat", "abc abc abc", "hello wörld", "x", "the the the cat"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculative_equals_plain(method, k):
    engine = make_engine()
    for prompt in PROMPTS:
        plain = engine.generate(request(engine, prompt, "off"))
        spec = engine.generate(request(engine, prompt, method, k))
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason
        assert spec.stats["drafted_tokens"] > 0


def test_speculation_actually_saves_target_forwards():
    engine = make_engine(noise=0.2)
    engine.generate(request(engine, method="off", max_tokens=80))
    plain_rounds = len(engine.target.eval_calls)
    engine.target.eval_calls.clear()
    result = engine.generate(request(engine, method="draft", k=4, max_tokens=80))
    assert result.stats["accepted_tokens"] > 0
    assert len(engine.target.eval_calls) < plain_rounds


def engine_generation(core):
    """The generation the core is running (one at a time here), or None once it has ended."""
    active = list(core._active.values())
    return active[0].generation if active else None


def test_caches_in_step_after_every_round():
    engine = make_engine()
    core = engine.core
    for method in ["off", "ngram", "draft"]:
        core.add(request(engine, method=method, k=5))
        finished = False
        while not finished:
            items = core.step()
            finished = any(getattr(item, "finish_reason", None) for _, item in items)
            gen = engine_generation(core)
            if gen is None:
                break
            # The target caches every committed token except the pending last one.
            assert engine.target.cached_tokens(0) == gen.context[:-1] or gen.finished
            assert engine.target_sequence.tokens == engine.target.cached_tokens(0)
            if method == "draft":
                draft_seq = engine.slots[0].draft
                assert draft_seq.tokens == engine.draft.cached_tokens(0)
                # The draft cache holds a prefix of the committed text plus at most k-1 unverified drafts.
                common = 0
                while common < min(len(draft_seq.tokens), len(gen.context)) and draft_seq.tokens[common] == gen.context[common]:
                    common += 1
                assert len(draft_seq.tokens) - common <= 4


def test_streams_drafting_with_the_model_share_each_draft_forward(monkeypatch):
    """Three streams drafting with the draft model: each draft position is one draft-backend call
    for all of them, not one per stream; later rounds are priced as sharing them three ways; every
    text is the one the stream gives alone."""
    engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.3), n_slots=3)
    prompts = PROMPTS[:3]
    alone = [engine.generate(request(engine, prompt, "draft", k=4, max_tokens=30)).text for prompt in prompts]
    engine.clear_cache()
    calls, sharers = [], []
    evaluate, plan_steps = engine.draft.eval_many, Generation.plan_steps

    def recording_eval_many(requests, *, prefill=False):
        if not prefill:
            calls.append(len(requests))
        return evaluate(requests, prefill=prefill)

    def recording_plan_steps(generation, streams=1, draft_sharers=1, rows_before=0):
        sharers.append(draft_sharers)
        return plan_steps(generation, streams, draft_sharers, rows_before)

    engine.draft.eval_many = recording_eval_many
    monkeypatch.setattr(Generation, "plan_steps", recording_plan_steps)
    core = engine.core
    handles = [core.add(request(engine, prompt, "draft", k=4, max_tokens=30)) for prompt in prompts]
    texts = {handle: "" for handle in handles}
    while core.busy:
        for handle, item in core.step():
            assert isinstance(item, (Started, StreamEvent)), item
            if isinstance(item, StreamEvent):
                texts[handle] += item.text
    assert [texts[handle] for handle in handles] == alone
    assert max(calls) == 3 and sum(calls) > len(calls)  # one call held all three streams' forwards
    assert sharers[:3] == [1, 1, 1] and 3 in sharers


def test_each_stream_plans_knowing_the_rows_the_streams_before_it_planned(monkeypatch):
    engine = Engine(FakeBackend(seed=7), n_slots=3)
    plan_steps, rounds = Generation.plan_steps, []

    def recording_plan_steps(generation, streams=1, draft_sharers=1, rows_before=0):
        tokens = yield from plan_steps(generation, streams, draft_sharers, rows_before)
        rounds[-1].append((rows_before, len(tokens) - 1))
        return tokens

    monkeypatch.setattr(Generation, "plan_steps", recording_plan_steps)
    core = engine.core
    for prompt in ("abc abc abc", "the the the cat", "the cat sat on the mat"):
        core.add(request(engine, prompt, "ngram", k=3, max_tokens=30))
    while core.busy:
        rounds.append([])
        core.step()
    assert sum(extra for plans in rounds for _, extra in plans) > 0  # some rounds proposed
    for plans in rounds:
        assert [before for before, _ in plans] == [sum(extra for _, extra in plans[:i]) for i in range(len(plans))]


def test_forwards_shared_by_several_streams_are_measured_for_auto():
    clock = FakeClock()
    engine = Engine(FakeBackend(seed=7, clock=clock, step_cost=0.010), n_slots=3, clock=clock)
    engine.cost_model = cost = CostModel({n: 0.010 * (1 + 0.1 * (n - 1)) for n in range(1, 9)})
    for prompt in ("abc abc abc", "the the the cat", "the cat sat on the mat"):
        engine.core.add(request(engine, prompt, "off", max_tokens=60, ignore_eos=True))
    while engine.core.busy:
        engine.core.step()
    # The fake evaluates each sequence of a shared call in turn: 3 x 10 ms for three one-row
    # sequences, where one sequence's three rows were priced 12 ms.
    assert cost.shared(3) == pytest.approx(0.030, rel=0.01)
    assert cost.target(3) == pytest.approx(0.012)  # one sequence's curve: only forwards timed alone


def test_max_tokens_and_length_finish():
    engine = make_engine()
    for method in ["off", "ngram", "draft"]:
        result = engine.generate(request(engine, method=method, max_tokens=7, k=8, ignore_eos=True))
        assert len(result.token_ids) == 7 and result.stats["generated_tokens"] == 7
        assert result.finish_reason == "length"


def test_context_limit_stops_all_methods_identically():
    engine = make_engine(n_ctx=40)
    outputs = {}
    for method in ["off", "ngram", "draft"]:
        result = engine.generate(request(engine, "abc", method=method, max_tokens=None, k=8, ignore_eos=True))
        assert result.finish_reason == "length"
        outputs[method] = result.token_ids
    assert outputs["off"] == outputs["ngram"] == outputs["draft"]
    assert len(outputs["off"]) + len(engine.encode_prompt("abc", chat=True)) == 41


def test_prompt_longer_than_context_is_refused():
    engine = make_engine(n_ctx=16)
    with pytest.raises(SpecdecError, match="context holds only 16"):
        engine.generate(request(engine, "a" * 40))


def test_eos_stops_without_emitting_it():
    engine = Engine(FakeBackend(seed=3, eog_bias=3.0))
    result = engine.generate(request(engine, method="off", max_tokens=200))
    assert result.finish_reason == "stop"
    assert not set(result.token_ids) & engine.target.eog_token_ids


@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_stop_strings_cut_text_and_never_stream_partially(method):
    engine = make_engine()
    full = engine.generate(request(engine, method="off", max_tokens=60, ignore_eos=True)).text
    stop = full[20:23]
    expected = full[: full.index(stop)]
    streamed = []
    final = None
    for event in engine.stream(request(engine, method=method, max_tokens=60, ignore_eos=True, stop=(stop,))):
        streamed.append(event.text)
        final = event
    assert "".join(streamed) == expected
    assert final.finish_reason == "stop"


def test_streaming_never_splits_a_utf8_character():
    engine = make_engine()
    e_acute = engine.target.tokenize("é")
    assert len(e_acute) == 2  # the fake vocabulary splits it over two tokens
    gen = engine.new_generation(request(engine, method="off", max_tokens=1))
    # Drive the assembler directly with the two halves.
    gen.assembler.add(engine.target.token_bytes(e_acute[0]))
    assert gen.assembler.take_delta() == ""
    gen.assembler.add(engine.target.token_bytes(e_acute[1]))
    assert gen.assembler.take_delta() == "é"


def test_seeded_sampling_is_reproducible_per_method():
    engine = make_engine()
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    for method in ["off", "ngram", "draft"]:
        a = engine.generate(request(engine, method=method, sampling=sampling))
        b = engine.generate(request(engine, method=method, sampling=sampling))
        assert a.token_ids == b.token_ids


def test_seeded_sampling_gives_the_same_text_with_and_without_n_gram_drafting():
    """Deterministic proposals are verified against the target's own position-keyed samples, so a
    seed fixes the text whatever is proposed: off, ngram at any k and auto (without a draft model,
    it proposes n-gram matches or nothing) agree token for token."""
    engine = Engine(FakeBackend(seed=7))
    drafted = accepted = 0
    for seed in range(6):
        sampling = SamplingParams(temperature=0.5, top_k=50, seed=seed)
        plain = engine.generate(request(engine, "abc abc abc abc", method="off", max_tokens=200, sampling=sampling))
        for method, k in (("ngram", 2), ("ngram", 5), ("auto", 4)):
            result = engine.generate(request(engine, "abc abc abc abc", method=method, k=k, max_tokens=200,
                                             sampling=sampling))
            assert result.token_ids == plain.token_ids, (seed, method, k)
            if method == "ngram":
                drafted += result.stats["drafted_tokens"]
                accepted += result.stats["accepted_tokens"]
    assert drafted > 0 and 0 < accepted < drafted  # proposals were made, some accepted, some rejected


def test_stats_keys_and_null_ratios():
    engine = make_engine()
    stats = engine.generate(request(engine, method="off", max_tokens=5)).stats
    for key in ["method", "prompt_tokens", "generated_tokens", "draft_rounds", "drafted_tokens",
                "accepted_tokens", "acceptance_rate", "mean_acceptance_length", "accepted_per_position",
                "draft_seconds", "verify_seconds", "prompt_seconds", "ttft_seconds", "total_seconds",
                "tokens_per_second"]:
        assert key in stats
    assert stats["acceptance_rate"] is None and stats["mean_acceptance_length"] is None
    spec = engine.generate(request(engine, method="draft", k=3, max_tokens=30)).stats
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["drafted_tokens"]
    assert spec["mean_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["draft_rounds"]
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]


def test_prefix_cache_reuses_the_prompt():
    engine = make_engine()
    first = engine.generate(request(engine, method="off", max_tokens=5))
    second = engine.generate(request(engine, method="ngram", max_tokens=5))
    assert first.stats["cached_prompt_tokens"] == 0
    assert second.stats["cached_prompt_tokens"] == second.stats["prompt_tokens"] - 1
    assert second.token_ids == first.token_ids


def test_draft_with_other_vocabulary_is_refused():
    target = FakeBackend()
    draft = FakeBackend()
    draft.pieces = draft.pieces[:-1]
    draft.vocab_size -= 1
    with pytest.raises(SpecdecError, match="vocabulary"):
        Engine(target, draft)


def test_draft_method_without_draft_model_is_a_clear_error():
    engine = Engine(FakeBackend())
    with pytest.raises(SpecdecError, match="draft model"):
        engine.generate(request(engine, method="draft"))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stop_string_inside_an_accepted_run_ends_there(method):
    engine = make_engine(noise=0.1)
    full = engine.generate(request(engine, method="off", max_tokens=60, ignore_eos=True))
    for start in range(5, 40, 3):
        stop = full.text[start:start + 2]
        plain = engine.generate(request(engine, method="off", max_tokens=60, ignore_eos=True, stop=(stop,)))
        spec = engine.generate(request(engine, method=method, k=6, max_tokens=60, ignore_eos=True, stop=(stop,)))
        assert spec.text == plain.text == full.text[: full.text.index(stop)]
        assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_every_streamed_token_names_who_produced_it(method):
    """Each event's token_sources matches its token_ids one for one: "target" for the target's own
    token of a round, the proposal's source for tokens it accepted (the playground colours them)."""
    engine = make_engine(noise=0.2)
    events = list(engine.stream(request(engine, method=method, max_tokens=60, k=4, ignore_eos=True)))
    assert all(len(event.token_sources) == len(event.token_ids) for event in events)
    sources = [source for event in events for source in event.token_sources]
    stats = events[-1].stats
    assert len(sources) == stats["generated_tokens"]
    assert sources.count("target") == len(sources) - stats["accepted_tokens"]
    assert set(sources) <= {"target", method}
    if method == "draft":  # the fake draft agrees with the target most of the time
        assert stats["accepted_tokens"] > 0 and set(sources) == {"target", "draft"}
