"""Constrained decoding on the fake backend: the grammar's state follows proposals and verdicts;
every method's constrained greedy text equals plain constrained decoding's; seeded sampling follows
the masked target distribution; forced tokens are proposed and always accepted; bad grammars are
refused with one clear sentence."""
import json

import numpy as np
import pytest

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.sampling.probs import softmax
from specdec.types import GenerationRequest, GrammarSpec, SamplingParams, SpecConfig, SpecdecError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "kind": {"enum": ["cat", "mat"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "kind", "count"], "additionalProperties": False}
JSON_SCHEMA = GrammarSpec("json_schema", json.dumps(SCHEMA))


def make_engine(noise=0.6):
    return Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=noise), n_slots=1)


def request(engine, method="off", k=4, grammar=JSON_SCHEMA, prompt="the cat sat on the mat", max_tokens=120, **kw):
    sampling = kw.pop("sampling", SamplingParams())
    return GenerationRequest(tuple(engine.encode_prompt(prompt, chat=True)), max_tokens, sampling,
                             SpecConfig(method, k), grammar=grammar, **kw)


def check_schema(text):
    value = json.loads(text)
    assert set(value) == {"name", "kind", "count"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert value["kind"] in ("cat", "mat") and 0 <= value["count"] <= 99


def test_constraint_cuts_forces_and_rolls_back():
    engine = make_engine()
    backend = engine.target
    constraint = engine.grammars.constraint(JSON_SCHEMA)
    ids = backend.tokenize('{"name": "x', add_special=False)
    assert constraint.admissible(ids) == len(ids)
    assert constraint.admissible(backend.tokenize("[1]", add_special=False)) == 0
    assert constraint.admissible(backend.tokenize('{"nam!', add_special=False)) == len('{"nam')
    assert backend.detokenize(constraint.forced_after(())) == '{"name": "'  # the schema's first key is forced
    allowed = constraint.allowed_after(())
    assert allowed[backend.tokenize("{", add_special=False)[0]] and allowed.sum() == 1
    constraint.commit(backend.tokenize('{"name": "', add_special=False))
    after_name = constraint.allowed_after(())
    assert after_name[backend.tokenize("x", add_special=False)[0]]
    with pytest.raises(AssertionError):
        constraint.commit(backend.tokenize("\n", add_special=False))  # a raw newline cannot be in a JSON string


@pytest.mark.parametrize("method", ["ngram", "draft", "auto"])
def test_constrained_greedy_equals_plain_constrained(method):
    engine = make_engine()
    for prompt in ["the cat sat on the mat", "abc abc abc", "x"]:
        plain = engine.generate(request(engine, "off", prompt=prompt))
        spec = engine.generate(request(engine, method, prompt=prompt))
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason == "stop"
        check_schema(plain.text)


def test_forced_tokens_are_proposed_and_accepted():
    engine = make_engine()
    result = engine.generate(request(engine, "ngram"))
    forced = result.stats["sources"]["grammar"]
    # Forced text is proposed in its canonical tokens; the model may spell it otherwise (verified like any draft).
    assert forced["drafted"] >= len('{"name": "') and forced["accepted"] >= forced["drafted"] // 2
    plain = engine.generate(request(engine, "off"))
    assert "grammar" not in plain.stats["sources"]  # plain decoding stays the baseline


def test_unconstrained_text_differs_and_is_not_json():
    engine = make_engine()
    free = engine.generate(request(engine, "off", grammar=None))
    with pytest.raises(ValueError):
        json.loads(free.text)


@pytest.mark.parametrize("method", ["ngram", "draft", "auto"])
def test_seeded_sampling_same_under_deterministic_proposals(method):
    engine = make_engine()
    sampling = SamplingParams(temperature=0.8, seed=11)
    plain = engine.generate(request(engine, "off", sampling=sampling))
    spec = engine.generate(request(engine, method, sampling=sampling))
    check_schema(plain.text)
    if method == "ngram":  # position-keyed noise: the same text whatever was proposed
        assert spec.token_ids == plain.token_ids
    else:
        check_schema(spec.text)


def test_sampled_draft_follows_the_masked_target_distribution_monte_carlo():
    """At the first free position (the name's first character) the draft method's token must be
    distributed as the masked target softmax, whatever the draft model proposed."""
    engine = make_engine(noise=1.5)
    backend = engine.target
    prefix = backend.tokenize('{"name": "', add_special=False)
    prompt = tuple(engine.encode_prompt("the cat", chat=True))
    constraint = engine.grammars.constraint(JSON_SCHEMA)
    constraint.commit(prefix)
    allowed = constraint.allowed_after(())
    reference = FakeBackend(seed=7)
    logits = reference.eval(0, 0, list(prompt) + prefix)[-1]
    expected = softmax(np.where(allowed, logits, -np.inf))
    counts = np.zeros(backend.vocab_size)
    runs = 600
    for seed in range(runs):
        result = engine.generate(request(engine, "draft", k=3, prompt="the cat", max_tokens=len(prefix) + 1,
                                         sampling=SamplingParams(temperature=1.0, seed=seed)))
        counts[result.token_ids[len(prefix)]] += 1
    assert counts[~allowed].sum() == 0
    top = np.argsort(-expected)[:5]
    for token in top:  # within 4.5 standard deviations of a binomial
        p = expected[token]
        assert abs(counts[token] / runs - p) <= 4.5 * np.sqrt(p * (1 - p) / runs) + 1e-9


def test_json_object_and_regex_and_lark():
    engine = make_engine()
    result = engine.generate(request(engine, "ngram", grammar=GrammarSpec("json_object")))
    assert isinstance(json.loads(result.text), dict)
    result = engine.generate(request(engine, "draft", grammar=GrammarSpec("regex", "(cat|mat)-[0-9]{2}")))
    assert result.text[:4] in ("cat-", "mat-") and result.text[4:].isdigit() and result.finish_reason == "stop"
    lark = 'start: "the " ANIMAL " sat"\nANIMAL: "cat" | "mat"'
    result = engine.generate(request(engine, "auto", grammar=GrammarSpec("lark", lark)))
    assert result.text in ("the cat sat", "the mat sat")


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json_schema", json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (GrammarSpec("json_schema", "{not json"), "JSON schema"),
    (GrammarSpec("json_schema", json.dumps({"$ref": "#/$defs/missing"})), "JSON schema"),
    (GrammarSpec("lark", "start: undefined_rule"), "grammar"),
    (GrammarSpec("regex", "(unclosed"), "regular expression"),
])
def test_bad_grammars_are_refused_clearly(spec, words):
    engine = make_engine()
    with pytest.raises(SpecdecError) as refused:
        engine.generate(request(engine, "off", grammar=spec))
    assert words in str(refused.value)
    assert "\n" not in str(refused.value)
