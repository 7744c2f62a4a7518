"""Report arithmetic on hand-made records: spreads, both speedup definitions, pooled acceptance,
the acceptance-length histogram, equality counts, and the files the report writes."""
import json

import pytest

from specdec.bench.report import (acceptance_length_counts, build_report, median_of_ratios, paired_values,
                                  quartiles, speedup_of_means, summarize)


def rec(prompt_id, config, tps, category="a", repeat=0, wall=1.0, generated=10, rounds=0, drafted=0, accepted=0,
        app=(), success=True, matches_off=None, **extra):
    method = config.split(":")[0]
    stats = {"method": method, "tokens_per_second": tps, "generated_tokens": generated, "draft_rounds": rounds,
             "drafted_tokens": drafted, "accepted_tokens": accepted, "accepted_per_position": list(app),
             "draft_seconds": 0.1, "verify_seconds": 0.9, "ttft_seconds": 0.2}
    return {"source": "specdec", "prompt_id": str(prompt_id), "category": category, "config": config,
            "method": method, "repeat": repeat, "success": success, "error": None if success else "boom",
            "wall_seconds": wall if success else None, "stats": stats if success else None,
            "matches_off": matches_off, **extra}


def test_quartiles_use_linear_percentiles():
    s = quartiles([40, 10, 30, 20])
    assert s == {"median": 25.0, "p25": 17.5, "p75": 32.5, "min": 10.0, "max": 40.0, "mean": 25.0}
    assert quartiles([]) == dict.fromkeys(("median", "p25", "p75", "min", "max", "mean"))


def test_speedup_ratio_of_means_and_median_of_ratios_differ():
    off = [rec(1, "off", 10.0), rec(2, "off", 20.0)]
    ngram = [rec(1, "ngram", 15.0), rec(2, "ngram", 20.0)]
    pairs = paired_values(ngram, off, lambda r: r["stats"]["tokens_per_second"])
    assert speedup_of_means(pairs) == pytest.approx(17.5 / 15.0)  # Spec-Bench: mean(tok/s) / mean(off tok/s)
    assert median_of_ratios(pairs) == pytest.approx(1.25)  # median of 1.5 and 1.0


def test_repeats_are_averaged_per_prompt_before_the_median():
    off = [rec(1, "off", 10.0, repeat=0), rec(1, "off", 30.0, repeat=1), rec(2, "off", 10.0)]
    cfg = [rec(1, "draft", 20.0, repeat=0), rec(1, "draft", 20.0, repeat=1), rec(2, "draft", 30.0)]
    pairs = paired_values(cfg, off, lambda r: r["stats"]["tokens_per_second"])
    # prompt 1: 20 / 20 = 1.0; prompt 2: 30 / 10 = 3.0 -> median 2.0
    assert median_of_ratios(pairs) == pytest.approx(2.0)


def test_failed_records_are_left_out_of_the_pairs():
    off = [rec(1, "off", 10.0), rec(2, "off", 20.0, success=False)]
    cfg = [rec(1, "ngram", 20.0), rec(2, "ngram", 1000.0)]
    pairs = paired_values(cfg, off, lambda r: r["stats"]["tokens_per_second"])
    assert [p[0] for p in pairs] == ["1"]
    assert speedup_of_means(pairs) == pytest.approx(2.0)


def test_acceptance_length_counts_from_per_position_acceptance():
    assert acceptance_length_counts({"draft_rounds": 10, "accepted_per_position": [6, 2]}) == [4, 4, 2]
    assert acceptance_length_counts({"draft_rounds": 3, "accepted_per_position": [3, 3, 3]}) == [0, 0, 0, 3]
    assert acceptance_length_counts({"draft_rounds": 0, "accepted_per_position": []}) == []


def test_summary_pools_acceptance_and_counts_equality():
    records = [
        rec(1, "off", 10.0), rec(2, "off", 10.0, category="b"),
        rec(1, "draft", 20.0, rounds=4, drafted=8, accepted=4, app=[3, 1], matches_off=True),
        rec(2, "draft", 15.0, category="b", rounds=6, drafted=12, accepted=0, app=[0, 0], matches_off=False),
    ]
    summary = summarize(records)
    assert list(summary) == ["a", "b", "overall"]
    overall = summary["overall"]["draft"]
    assert overall["mean_acceptance_length"] == pytest.approx(1 + 4 / 10)  # pooled, not the mean of 2.0 and 1.0
    assert overall["acceptance_rate"] == pytest.approx(4 / 20)
    assert (overall["identical_to_off"], overall["compared_with_off"]) == (1, 2)
    assert overall["speedup_mean"] == pytest.approx(17.5 / 10)
    assert summary["a"]["draft"]["speedup_mean"] == pytest.approx(2.0)
    assert summary["b"]["draft"]["speedup_mean"] == pytest.approx(1.5)
    assert summary["overall"]["off"]["mean_acceptance_length"] is None
    # e2e: generated / wall = 10 tok/s for every record here -> 1.0
    assert overall["e2e_speedup"] == pytest.approx(1.0)


def test_build_report_writes_every_file(tmp_path):
    records = [
        rec(1, "off", 10.0), rec(1, "ngram:k2", 12.0, rounds=2, drafted=4, accepted=2, app=[2, 0], matches_off=True),
        rec(2, "off", 10.0), rec(2, "ngram:k2", 9.0, rounds=2, drafted=4, accepted=1, app=[1, 0], matches_off=False,
                                  first_diff_position=5, off_token=7, token=9, target_logit_margin=0.0312),
        rec(3, "ngram:k2", None, success=False),
    ]
    report = build_report(records, {"temperature": 0.0, "max_tokens": 16}, {"llama-server": "not run: x"}, tmp_path)
    for name in ("report.md", "report.json", "speedup_by_category.png", "acceptance_length_histogram.png"):
        assert (tmp_path / name).exists(), name
    assert (tmp_path / "speedup_by_category.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["summary"]["overall"]["ngram:k2"]["speedup_mean"] == pytest.approx(10.5 / 10)
    assert saved["acceptance_length_histogram"]["ngram:k2"] == [1, 3, 0]
    assert saved["differences"][0]["first_diff_position"] == 5
    markdown = (tmp_path / "report.md").read_text()
    assert "| 2 | a | ngram:k2 | 0 | 5 | 7 | 9 | 0.0312 |" in markdown
    assert "not run: x" in markdown
    assert "## Failures" in markdown and "boom" in markdown
    assert report["summary"]["overall"]["ngram:k2"]["failed"] == 1


def test_adaptive_decisions_are_summed_and_shown_as_shares(tmp_path):
    records = [rec(1, "off", 10.0), rec(2, "off", 10.0),
               rec(1, "auto", 10.0, choices={"none": 6, "ngram:k3": 2}),
               rec(2, "auto", 10.0, choices={"none": 2})]
    for record in records[2:]:
        record["stats"]["choices"] = record.pop("choices")
    report = build_report(records, {"temperature": 0}, {}, tmp_path)
    assert report["summary"]["overall"]["auto"]["choices"] == {"none": 8, "ngram:k3": 2}
    markdown = (tmp_path / "report.md").read_text()
    assert "| auto | overall | 10 | none 80.0%, ngram:k3 20.0% | — |" in markdown  # records without sources
    records[2]["stats"]["sources"] = {"ngram": {"rounds": 2, "drafted": 6, "accepted": 3}}
    report = build_report(records, {"temperature": 0}, {}, tmp_path)
    assert report["summary"]["overall"]["auto"]["sources"] == {
        "ngram": {"rounds": 2, "drafted": 6, "accepted": 3, "mean_acceptance_length": 2.5, "acceptance_rate": 0.5}}
    markdown = (tmp_path / "report.md").read_text()
    assert "| auto | overall | 10 | none 80.0%, ngram:k3 20.0% | ngram 2, 2.50, 0.50 |" in markdown
