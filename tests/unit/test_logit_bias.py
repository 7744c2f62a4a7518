"""OpenAI's logit_bias on the fake backend: -100 bans a token, +100 forces one, every method gives
the same greedy text under one bias (drafts are verified against the biased target), seeded
sampling with a bias is reproducible and follows softmax(logits + bias), the grammar's mask wins
over any bias, and bad biases are refused with one clear sentence."""
from collections import Counter

import numpy as np
import pytest
from fakes.clock import FakeClock

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.sampling.probs import biased_logits, softmax, token_distribution
from specdec.types import GenerationRequest, GrammarSpec, SamplingParams, SpecConfig, SpecdecError

PROMPTS = ["the cat sat on the mat", "abc abc abc", "x"]
EOG = (0, 1)  # the fake backend's end-of-generation tokens


def make_engine(noise=0.3):
    # Flat verification costs on a fake clock: `auto` finds drafting worth it (as in test_auto.py).
    clock = FakeClock()
    target = FakeBackend(seed=7, clock=clock, step_cost=0.050, token_cost=0.0005)
    draft = FakeBackend(seed=7, noise=noise, clock=clock, step_cost=0.002)
    return Engine(target, draft, clock=clock)


def request(engine, prompt="the cat sat on the mat", method="off", k=4, max_tokens=60, **kw):
    sampling = kw.pop("sampling", SamplingParams())
    return GenerationRequest(tuple(engine.encode_prompt(prompt, chat=True)), max_tokens, sampling,
                             SpecConfig(method, k), **kw)


def most_frequent(tokens):
    return Counter(t for t in tokens if t not in EOG).most_common(1)[0][0]


# -- the canonical form and validation ---------------------------------------------------------
def test_a_mapping_becomes_sorted_pairs_and_stays_hashable():
    params = SamplingParams(logit_bias={"7": 1, 3: -2.5})
    assert params.logit_bias == ((3, -2.5), (7, 1.0))
    assert params == SamplingParams(logit_bias=[(7, 1.0), (3, -2.5)])
    assert hash(params) == hash(SamplingParams(logit_bias=((3, -2.5), (7, 1))))
    assert SamplingParams(logit_bias={}).logit_bias == ()
    params.validate()


@pytest.mark.parametrize("bias, message", [
    ({5: 100.5}, "[-100, 100]"),
    ({5: -101}, "[-100, 100]"),
    ({5: float("nan")}, "[-100, 100]"),
    ({-1: 1.0}, ">= 0"),
    (((4, 1.0), (4, 2.0)), "more than once"),
])
def test_out_of_range_biases_are_refused(bias, message):
    params = SamplingParams(logit_bias=bias)
    with pytest.raises(SpecdecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        params.validate()
    engine = make_engine()
    with pytest.raises(SpecdecError):  # the engine validates every request it is given
        engine.generate(request(engine, max_tokens=3, sampling=params))


@pytest.mark.parametrize("bias", [{"cat": 1}, {1.5: 1}, {True: 1}, {3: "high"}, [(3,)], 7])
def test_malformed_biases_are_refused(bias):
    with pytest.raises(SpecdecError, match="logit_bias must map token ids"):
        SamplingParams(logit_bias=bias)


def test_a_token_id_outside_the_vocabulary_is_refused():
    engine = make_engine()
    vocab = engine.target.vocab_size
    SamplingParams(logit_bias={vocab - 1: 1}).check_vocabulary(vocab)
    with pytest.raises(SpecdecError, match=f"vocabulary has only {vocab} tokens"):
        engine.generate(request(engine, max_tokens=3, sampling=SamplingParams(logit_bias={vocab: 1})))
    with pytest.raises(SpecdecError, match="vocabulary"):
        biased_logits(np.zeros(vocab, dtype=np.float32), ((vocab, 1.0),))


# -- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["off", "ngram", "draft", "auto"])
def test_minus_100_bans_a_token_the_unbiased_run_emits(method):
    engine = make_engine()
    plain = engine.generate(request(engine, method="off"))
    banned = most_frequent(plain.token_ids)
    result = engine.generate(request(engine, method=method, sampling=SamplingParams(logit_bias={banned: -100})))
    assert banned not in result.token_ids
    assert len(result.token_ids) > 0 and result.token_ids != plain.token_ids


@pytest.mark.parametrize("method", ["off", "ngram", "draft", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_plus_100_forces_a_token(method, temperature):
    engine = make_engine()
    forced = engine.target.tokenize("q", add_special=False)[0]
    sampling = SamplingParams(temperature=temperature, seed=3, logit_bias={forced: 100})
    result = engine.generate(request(engine, method=method, max_tokens=40, sampling=sampling))
    assert result.token_ids == [forced] * 40 and result.finish_reason == "length"


def banning_bias(engine):
    """A bias that changes the greedy text much: the unbiased run's two most frequent tokens banned,
    some pushed up, some down by amounts that reorder the candidates without forcing any."""
    plain = engine.generate(request(engine, method="off", max_tokens=80))
    counts = [t for t, _ in Counter(t for t in plain.token_ids if t not in EOG).most_common(4)]
    letters = engine.target.tokenize("aeiou", add_special=False)
    return {counts[0]: -100, counts[1]: -100, counts[2]: -3.5, **{t: 2.5 for t in letters}}, plain


def test_every_method_gives_the_same_greedy_text_under_one_bias():
    engine = make_engine()
    bias, unbiased = banning_bias(engine)
    sampling = SamplingParams(logit_bias=bias)
    for prompt in PROMPTS:
        plain = engine.generate(request(engine, prompt, "off", max_tokens=80, sampling=sampling))
        assert plain.token_ids and not {t for t, b in bias.items() if b == -100} & set(plain.token_ids)
        for method, k in (("ngram", 3), ("draft", 4), ("draft", 1), ("auto", 6)):
            engine.reset_cross_request_state()
            spec = engine.generate(request(engine, prompt, method, k, max_tokens=80, sampling=sampling))
            assert spec.token_ids == plain.token_ids, (prompt, method, k)
            assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
            if method == "draft":
                assert spec.stats["accepted_tokens"] > 0  # proposals were verified against the biased target
    assert engine.generate(request(engine, "the cat sat on the mat", "off", max_tokens=80,
                                   sampling=sampling)).token_ids != unbiased.token_ids


def test_no_bias_copies_nothing():
    row = np.arange(6, dtype=np.float32)
    assert biased_logits(row, ()) is row
    biased = biased_logits(row, ((1, 2.0), (4, -100.0)))
    assert biased is not row and row[1] == 1.0  # the bias never writes into the backend's rows
    assert biased[1] == 3.0 and biased[4] == -np.inf and biased[0] == 0.0
    assert token_distribution(row, SamplingParams(logit_bias={5: -100}))[4] == 1.0  # greedy: argmax of the biased row


def test_banning_every_token_is_an_error_not_a_guess():
    engine = make_engine()
    everything = {t: -100 for t in range(engine.target.vocab_size)}
    with pytest.raises(SpecdecError, match="bans every token"):
        engine.generate(request(engine, max_tokens=3, sampling=SamplingParams(logit_bias=everything)))


# -- sampling ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_seeded_sampling_with_a_bias_is_reproducible(method):
    engine = make_engine()
    bias, _ = banning_bias(engine)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11, logit_bias=bias)
    a = engine.generate(request(engine, method=method, max_tokens=80, sampling=sampling))
    b = engine.generate(request(engine, method=method, max_tokens=80, sampling=sampling))
    assert a.token_ids == b.token_ids and a.token_ids
    assert not {t for t, v in bias.items() if v == -100} & set(a.token_ids)
    if method == "ngram":  # position-keyed noise: deterministic proposals never change the text
        off = engine.generate(request(engine, method="off", max_tokens=80, sampling=sampling))
        assert a.token_ids == off.token_ids
    unbiased = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    assert engine.generate(request(engine, method=method, max_tokens=80, sampling=unbiased)).token_ids != a.token_ids


@pytest.mark.parametrize("method", ["off", "draft"])
def test_the_first_sampled_token_follows_the_biased_distribution(method):
    """Many seeds, one prompt: the first token's frequencies match softmax(logits + bias) (not the
    unbiased softmax), also when an unbiased draft model proposes it and the rejection rule decides."""
    engine = make_engine(noise=0.6)
    prompt = tuple(engine.encode_prompt("the cat sat on the mat", chat=True))
    logits = FakeBackend(seed=7)._row(list(prompt))  # the target's row for the first generated token
    order = np.argsort(-logits)
    # Ban the end tokens (so a first token always exists) and the likeliest token; lift the 6th and 12th.
    bias = {0: -100, 1: -100, int(order[0]): -100, int(order[5]): 2.0, int(order[11]): 3.0}
    expected = softmax(biased_logits(logits, SamplingParams(logit_bias=bias).logit_bias))
    unbiased = softmax(logits)
    runs = 2500
    counts = np.zeros(logits.size)
    for seed in range(runs):
        sampling = SamplingParams(temperature=1.0, seed=seed, logit_bias=bias)
        # max_tokens 3 leaves room for a 2-token draft whose first position decides the first token.
        result = engine.generate(GenerationRequest(prompt, 3, sampling, SpecConfig(method, 2)))
        counts[result.token_ids[0]] += 1
    if method == "draft":
        assert engine.generate(GenerationRequest(prompt, 3, SamplingParams(1.0, seed=0, logit_bias=bias),
                                                 SpecConfig("draft", 2))).stats["drafted_tokens"] > 0
    assert counts[[0, 1, order[0]]].sum() == 0
    frequent = expected * runs >= 5
    z = (counts - runs * expected)[frequent] / np.sqrt(runs * expected * (1 - expected))[frequent]
    assert np.abs(z).max() < 4.5, z
    total_variation = 0.5 * np.abs(counts / runs - expected).sum()
    assert total_variation < 0.06
    assert 0.5 * np.abs(expected - unbiased).sum() > 0.3  # the bias moved the distribution far


# -- the grammar's mask after the bias ------------------------------------------------------------
@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_the_grammar_mask_wins_over_any_bias(method):
    pytest.importorskip("llguidance")
    engine = make_engine()
    tok = {c: engine.target.tokenize(c, add_special=False)[0] for c in "abz"}
    grammar = GrammarSpec("regex", "[ab]{12}")
    plain = engine.generate(request(engine, method=method, max_tokens=40, grammar=grammar))
    assert len(plain.text) == 12 and set(plain.text) <= {"a", "b"}
    banned = Counter(plain.text).most_common(1)[0][0]
    kept = "b" if banned == "a" else "a"
    # +100 on z, which the grammar forbids, and -100 on the letter plain text uses most: only the other is left.
    sampling = SamplingParams(logit_bias={tok["z"]: 100, tok[banned]: -100})
    result = engine.generate(request(engine, method=method, max_tokens=40, sampling=sampling, grammar=grammar))
    assert result.text == kept * 12 and result.finish_reason == "stop"
    with pytest.raises(SpecdecError, match="bans every token the grammar allows"):
        engine.generate(request(engine, method=method, max_tokens=40, grammar=grammar,
                                sampling=SamplingParams(logit_bias={tok["a"]: -100, tok["b"]: -100})))
