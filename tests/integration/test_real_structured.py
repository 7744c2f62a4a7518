"""Structured output on the real pair: under every method the constrained greedy text equals
constrained plain decoding token for token, parses, validates against its schema, and the
grammar's forced tokens are proposed and accepted."""
import json

import jsonschema
import pytest

from specdec.types import GenerationRequest, GrammarSpec, SpecConfig

CASES = [
    ("Extract the ticket as JSON: 'Hi, I am Maria Lopez (maria@acme.com). Since Monday our 230 invoices "
     "are not syncing to the ERP. Account AC-55821. This is urgent.'",
     {"type": "object", "properties": {
         "name": {"type": "string"}, "email": {"type": "string"}, "account": {"type": "string"},
         "priority": {"enum": ["low", "medium", "high", "urgent"]}, "affected": {"type": "integer"}},
      "required": ["name", "email", "account", "priority", "affected"], "additionalProperties": False}),
    ("Describe the function `def add(a, b=1): return a + b` as JSON.",
     {"type": "object", "properties": {
         "name": {"type": "string"},
         "parameters": {"type": "array", "items": {"type": "object", "properties": {
             "name": {"type": "string"}, "default": {"type": ["string", "null"]}},
             "required": ["name", "default"], "additionalProperties": False}},
         "returns": {"type": "string"}},
      "required": ["name", "parameters", "returns"], "additionalProperties": False}),
]


@pytest.mark.parametrize("prompt,schema", CASES, ids=["ticket", "function"])
def test_constrained_greedy_equal_under_every_method(real_engine, prompt, schema):
    prompt_ids = tuple(real_engine.encode_prompt(prompt, chat=True))
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    outputs, stats = {}, {}
    for method in ("off", "ngram", "draft", "auto"):
        result = real_engine.generate(GenerationRequest(prompt_ids, 160, spec=SpecConfig(method, 4), grammar=grammar))
        outputs[method], stats[method] = result.token_ids, result.stats
        assert result.finish_reason == "stop", method
    assert outputs["ngram"] == outputs["off"]
    assert outputs["draft"] == outputs["off"]
    assert outputs["auto"] == outputs["off"]
    jsonschema.validate(json.loads(real_engine.target.detokenize(outputs["off"])), schema)
    forced = stats["ngram"]["sources"]["grammar"]
    assert forced["accepted"] > 0 and forced["accepted"] <= forced["drafted"]
