"""`specdec batch` end to end against the fake server, through specdec.cli.main, in process."""
from __future__ import annotations

import json

import pytest

from fakes.openai_server import FakeServer, FakeServerConfig
from specdec.cli import main

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server():
    with FakeServer(FakeServerConfig(token_delay=0.002)) as running:
        yield running


def write_input(path, n=6, extra=()):
    entries = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(n)]
    entries += list(extra)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_with_report(tmp_path, server, capsys):
    inp = write_input(tmp_path / "in.jsonl", extra=[{"id": "retry-me", "prompt": "p [[faults: 429]]", "max_tokens": 3}])
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {"fake-model": {"input_per_million": 1.0, "output_per_million": 4.0}}}))
    out = tmp_path / "out.jsonl"
    rc = main(["batch", str(inp), "--out", str(out), "--base-url", server.base_url, "--concurrency", "3",
               "--max-tokens", "5", "--temperature", "0", "--speculative", "ngram", "--report",
               str(tmp_path / "report.md"), "--prices", str(prices), "--machine-hour-price", "1.5"])
    assert rc == 0
    lines = records(out)
    assert sorted(r["id"] for r in lines) == sorted([f"q{i}" for i in range(6)] + ["retry-me"])
    assert all(r["error"] is None for r in lines)
    retried = next(r for r in lines if r["id"] == "retry-me")
    assert [a["status_code"] for a in retried["attempts"]] == [429, 200] and retried["text"] == "t0 t1 t2 "
    bodies = [r.body for r in server.requests]
    assert all(b["model"] == "fake-model" and b["temperature"] == 0 for b in bodies)
    assert all(b["speculative_decoding"] == {"method": "ngram"} for b in bodies)
    assert sorted(b["max_tokens"] for b in bodies) == [3, 3] + [5] * 6
    doc = json.loads((tmp_path / "report.json").read_text())
    run = doc["runs"][0]
    assert run["requests"]["ok"] == 7 and run["requests"]["retried"] == 1
    assert run["tokens"]["completion"] == 6 * 5 + 3
    expected = (run["tokens"]["prompt"] * 1.0 + run["tokens"]["completion"] * 4.0) / 1e6
    assert run["cost"]["token_pricing"]["total_usd"] == pytest.approx(expected)
    assert run["cost"]["compute_pricing"]["machine_hour_usd"] == 1.5
    assert run["speculative"]["methods"] == ["ngram"]
    assert "# specdec batch report" in (tmp_path / "report.md").read_text()
    assert "7/7 ok" in capsys.readouterr().out


def test_compare_runs_off_then_on(tmp_path, server, capsys):
    inp = write_input(tmp_path / "in.jsonl", n=4)
    out = tmp_path / "res.jsonl"
    rc = main(["batch", str(inp), "--out", str(out), "--base-url", server.base_url, "--model", "fake-model",
               "--compare", "--report", str(tmp_path / "r.md"), "--machine-hour-price", "2"])
    assert rc == 0
    off, on = records(tmp_path / "res.off.jsonl"), records(tmp_path / "res.on.jsonl")
    assert len(off) == len(on) == 4 and not out.exists()
    assert all(r["usage"].get("speculative") is None and r["speculative_decoding"] is False for r in off)
    assert all(r["speculative_decoding"] is True for r in on)
    assert all(r["usage"]["speculative"]["method"] == "ngram" for r in on)
    flags = [r.body["speculative_decoding"] for r in server.requests]
    assert flags == [False] * 4 + [True] * 4  # off first, then on, same prompts
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [run["label"] for run in doc["runs"]] == ["off", "on"]
    c = doc["comparison"]
    assert c["identical_texts"] == 4 and c["output_tokens_per_second_speedup"] is not None
    assert c["compute_cost_per_million_output_tokens_saving"] is not None
    assert "## on vs off" in (tmp_path / "r.md").read_text()


def test_failures_exit_1_and_a_rerun_retries_only_them(tmp_path, server, capsys):
    inp = write_input(tmp_path / "in.jsonl", n=3, extra=[{"id": "bad", "prompt": "x [[always: 400]]"}])
    out = tmp_path / "out.jsonl"
    argv = ["batch", str(inp), "--out", str(out), "--base-url", server.base_url, "--model", "fake-model"]
    assert main(argv) == 1
    assert "1 request(s) did not succeed" in capsys.readouterr().err
    assert len(server.requests) == 4  # no retry of the 400
    assert main(argv) == 1
    assert [r.key for r in server.requests[4:]] == ["x [[always: 400]]"]
    lines = records(out)
    assert [r["id"] for r in lines].count("bad") == 2 and len(lines) == 5
    doc_reasons = [r for r in lines if r["id"] == "bad"][-1]["error"]
    assert "messages must not be empty" in doc_reasons


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ('{broken\n{"prompt": "x"}\n', "line 1 is not valid JSON"),
    ('{"prompt": "x"}\n', "line 1 has no id"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, content, message):
    inp = tmp_path / "in.jsonl"
    if content is not None:
        inp.write_text(content)
    rc = main(["batch", str(inp), "--out", str(tmp_path / "out.jsonl"), "--base-url", "http://127.0.0.1:9/v1"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1 and err.startswith("specdec: error:")
    assert not (tmp_path / "out.jsonl").exists()


def test_unreachable_server_without_model_is_a_one_line_error(tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", n=1)
    rc = main(["batch", str(inp), "--out", str(tmp_path / "o.jsonl"), "--base-url", "http://127.0.0.1:9/v1",
               "--max-attempts", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot list models" in err and err.count("\n") == 1


def test_compare_with_speculative_off_is_refused(tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", n=1)
    rc = main(["batch", str(inp), "--out", str(tmp_path / "o.jsonl"), "--compare", "--speculative", "off"])
    assert rc == 2 and "--compare" in capsys.readouterr().err


def test_api_key_from_environment(tmp_path, server, monkeypatch, capsys):
    server.config.api_key = "k-123"
    inp = write_input(tmp_path / "in.jsonl", n=2)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("SPECDEC_API_KEY", "k-123")
    assert main(["batch", str(inp), "--out", str(tmp_path / "o.jsonl"), "--base-url", server.base_url]) == 0
    monkeypatch.setenv("SPECDEC_API_KEY", "wrong")
    rc = main(["batch", str(inp), "--out", str(tmp_path / "o2.jsonl"), "--base-url", server.base_url,
               "--model", "fake-model"])
    assert rc == 1 and all(r["error_type"] == "AuthenticationError" for r in records(tmp_path / "o2.jsonl"))
