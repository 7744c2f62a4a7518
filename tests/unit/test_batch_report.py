"""The report on hand-made records: final state per id, percentiles, wall time, costs, compare."""
from __future__ import annotations

import json

import pytest

from specdec.client.cost import PriceTable, TokenPrice
from specdec.client.report import (
    build_report,
    busy_seconds,
    render_markdown,
    summarize,
    summarize_file,
    write_report,
)
from specdec.types import SpecdecError


def ok(id_, latency, ttft=None, prompt=10, completion=20, start=0.0, end=None, text="t", spec=None, model="m",
       attempts=1):
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if spec:
        usage["speculative"] = spec
    return {"id": id_, "text": text, "usage": usage, "latency_seconds": latency, "ttft_seconds": ttft,
            "attempts": [{"number": n + 1} for n in range(attempts)], "error": None, "model": model,
            "started_at": start, "finished_at": start + latency if end is None else end}


def failed(id_, error="HTTP 500 server_error: boom", start=0.0, end=1.0, attempts=3):
    return {"id": id_, "text": None, "usage": None, "latency_seconds": None, "ttft_seconds": None,
            "attempts": [{"number": n + 1} for n in range(attempts)], "error": error, "model": "m",
            "started_at": start, "finished_at": end}


def test_busy_seconds_is_the_union_of_intervals():
    assert busy_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert busy_seconds([(5, 6), (0, 10)]) == 10
    assert busy_seconds([]) == 0


def test_summary_final_state_per_id():
    records = [
        failed("a", start=0, end=1),  # a failed first, then succeeded on a rerun
        ok("b", 1.0, ttft=0.1, start=0, completion=30),
        ok("a", 3.0, ttft=0.3, start=10, completion=10),
        failed("c", error="HTTP 400 invalid_request_error: bad"),
        failed("c", error="HTTP 400 invalid_request_error: bad"),
        ok("zzz", 9.0, start=100),  # not in this batch's input
    ]
    s = summarize(records, ids=["a", "b", "c", "d"])
    assert (s.requests, s.ok, s.failed, s.not_run) == (4, 2, 1, 1)
    assert s.failure_reasons == (("HTTP 400 invalid_request_error: bad", 1),)
    assert (s.prompt_tokens, s.completion_tokens) == (20, 40)
    assert s.latency.mean == 2.0 and s.ttft.mean == pytest.approx(0.2)
    latency = build_report([s], PriceTable({}), None)["runs"][0]["latency_seconds"]
    assert latency == {"count": 2, "mean": 2.0, "p50": 2.0, "p95": pytest.approx(2.9), "p99": pytest.approx(2.98)}
    # a: [0,1] and [10,13]; b: [0,1]; c: [0,1] twice → union 1 + 3 = 4 seconds
    assert s.wall_seconds == 4.0
    assert s.output_tokens_per_second == 10.0 and s.requests_per_second == 0.5
    assert s.retried == 2  # a (two lines) and c (three attempts each)
    assert s.duplicate_successes == 0


def test_speculative_aggregate():
    spec1 = {"method": "ngram", "draft_rounds": 4, "drafted_tokens": 12, "accepted_tokens": 6}
    spec2 = {"method": "ngram", "draft_rounds": 6, "drafted_tokens": 18, "accepted_tokens": 3}
    s = summarize([ok(1, 1.0, spec=spec1), ok(2, 1.0, spec=spec2), ok(3, 1.0)])
    assert s.speculative["acceptance_rate"] == pytest.approx(9 / 30)
    assert s.speculative["mean_acceptance_length"] == pytest.approx(1 + 9 / 10)
    assert s.speculative["requests"] == 2


def test_costs_in_report_and_missing_prices_said_so():
    s = summarize([ok(1, 1800.0, prompt=1_000_000, completion=250_000, model="priced"),
                   ok(2, 1800.0, start=1800.0, prompt=10, completion=10, model="unpriced")])
    table = PriceTable({"priced": TokenPrice(0.5, 2.0, "test")})
    doc = build_report([s], table, machine_hour_usd=2.0)
    token_view = doc["runs"][0]["cost"]["token_pricing"]
    priced = next(m for m in token_view["models"] if m["model"] == "priced")
    assert priced["input_usd"] == pytest.approx(0.5) and priced["output_usd"] == pytest.approx(0.5)
    assert token_view["total_usd"] is None and "no price configured for 'unpriced'" in token_view["note"]
    compute = doc["runs"][0]["cost"]["compute_pricing"]
    assert compute["wall_seconds"] == 3600.0 and compute["total_usd"] == pytest.approx(2.0)
    assert compute["per_million_output_tokens_usd"] == pytest.approx(2.0 / 250_010 * 1e6)
    markdown = render_markdown(doc)
    assert "no price configured for 'unpriced'" in markdown and "$2.00" in markdown

    no_prices = build_report([s], PriceTable({}), machine_hour_usd=None)
    md = render_markdown(no_prices)
    assert "no machine-hour price configured" in md and "no price configured for 'priced'" in md
    assert no_prices["runs"][0]["cost"]["token_pricing"]["total_usd"] is None


def test_compare_section():
    off = summarize([ok(i, 2.0, ttft=0.2, start=2.0 * i, completion=100, text=f"x{i}") for i in range(4)], label="off")
    on = summarize([ok(i, 1.0, ttft=0.2, start=1.0 * i, completion=100, text=f"x{i}" if i else "other")
                    for i in range(4)], label="on")
    doc = build_report([off, on], PriceTable({}), machine_hour_usd=3.6)
    c = doc["comparison"]
    assert c["latency_mean_change"] == pytest.approx(-0.5)
    assert c["output_tokens_per_second_speedup"] == pytest.approx(2.0)
    assert c["compute_cost_per_million_output_tokens_saving"] == pytest.approx(0.5)
    assert (c["identical_texts"], c["compared_texts"]) == (3, 4)
    off_cost = doc["runs"][0]["cost"]["compute_pricing"]["per_million_output_tokens_usd"]
    assert off_cost == pytest.approx(3.6 * 8 / 3600 / 400 * 1e6)  # 8 s for 400 tokens at $3.60/h
    md = render_markdown(doc)
    assert "## on vs off" in md and "| off | on |" in md and "+50.0 %" in md
    assert build_report([off, on], PriceTable({}), None)["comparison"]["compute_cost_per_million_output_tokens_saving"] is None


def test_write_report_md_and_json(tmp_path):
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps(ok("a", 1.0)) + "\n" + '{"id": "b", "te')  # torn tail tolerated
    s = summarize_file(results, ["a", "b"])
    assert (s.ok, s.not_run, s.unreadable_lines) == (1, 1, 1)
    md, js = write_report(tmp_path / "out" / "report.md", build_report([s], PriceTable({}), None))
    assert md.read_text().startswith("# specdec batch report")
    assert json.loads(js.read_text())["runs"][0]["requests"]["ok"] == 1
    with pytest.raises(SpecdecError):
        write_report(tmp_path / "report.json", {})


def test_schema_valid_outputs_are_counted():
    from specdec.client.structured import schema_valid

    form = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    assert schema_valid('{"a": 1}', form) is True
    assert schema_valid('{"a": "1"}', form) is False
    assert schema_valid('{"a": 1', form) is False
    assert schema_valid("[]", {"type": "json_object"}) is False
    assert schema_valid("anything", {"type": "text"}) is None and schema_valid("x", None) is None
    records = [{**ok("a", 1.0), "schema_valid": True}, {**ok("b", 1.0), "schema_valid": False}, ok("c", 1.0)]
    summary = summarize(records)
    assert summary.structured == (1, 2)
    assert "| schema-valid (of those with a response_format) | 1/2 |" in render_markdown(
        build_report([summary], PriceTable({}), None))
