"""No poison items: input lines that cannot be parsed and results that cannot be written become
error records naming their line, the run goes on, and a rerun resumes past them. JSON Lines are
split on "\\n" only."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from fakes.openai_server import FakeServer, FakeServerConfig
from specdec.cli import main
from specdec.client import AsyncClient, RetryPolicy, Timeouts
from specdec.client import batch
from specdec.client.batch import (
    MAX_INT_DIGITS,
    MAX_NESTING,
    BatchSettings,
    read_input,
    read_results,
    run_batch,
)
from specdec.client.cost import load_price_table
from specdec.client.report import build_report, summarize, write_report

pytestmark = pytest.mark.timeout(30)
MODEL = "fake-model"
ANSWER = "t0 t1 t2 t3 t4 t5 t6 t7 "
SEPARATORS = "a\u2028b\u2029c\x85d"  # str.splitlines() breaks a line at each of these


def chat(item_id, content="q"):
    return json.dumps({"id": item_id, "messages": [{"role": "user", "content": content}]}, ensure_ascii=False)


def strict_records(path):
    """Every line of a results file, read as strict JSON from strict UTF-8 (no NaN, no torn line)."""
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    text = path.read_bytes().decode("utf-8")
    assert text.endswith("\n")
    return [json.loads(line, parse_constant=no_constant) for line in text.split("\n")[:-1]]


def run(server, items, out, **settings):
    async def no_wait(seconds):
        await asyncio.sleep(0)

    async def main_():
        async with AsyncClient(server.base_url, sleep=no_wait, rng=random.Random(0), retry=RetryPolicy(max_attempts=2),
                               timeouts=Timeouts(total=5.0)) as client:
            return await run_batch(client, items, out, BatchSettings(model=MODEL, concurrency=2, **settings))

    return asyncio.run(main_())


class RewriteBodies:
    """ASGI middleware: replaces bytes in every response body chunk (streamed answers only: a JSON
    body's Content-Length would no longer match)."""

    def __init__(self, app, replacements):
        self.app, self.replacements = app, replacements

    async def __call__(self, scope, receive, send):
        async def rewritten(message):
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                for old, new in self.replacements:
                    body = body.replace(old, new)
                message = {**message, "body": body}
            await send(message)

        await self.app(scope, receive, rewritten)


def rewriting_server(*replacements):
    server = FakeServer(FakeServerConfig())
    server.app.add_middleware(RewriteBodies, replacements=replacements)
    return server


# -- the whole command -----------------------------------------------------------------------------------

def test_poison_lines_become_error_records_and_a_rerun_resumes(tmp_path, capsys):
    lines = [
        chat("g1"),
        '{"id": "sur\\ud800", "messages": [{"role": "user", "content": "lone surrogate id"}]}',
        chat("g3") + "\r",  # CRLF line end
        chat("ls", SEPARATORS),
        chat("g5"),
        '{"id": "big", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
        chat("g7"),
        '{"id": "deep", "prompt": "x", "n": ' + "[" * 10_000 + "]" * 10_000 + "}",
        chat("g9"),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    with FakeServer(FakeServerConfig()) as server:
        argv = ["batch", str(inp), "--out", str(out), "--base-url", server.base_url, "--model", MODEL,
                "--concurrency", "2"]
        assert main(argv) == 1
        captured = capsys.readouterr()
        assert "7/9 ok, 2 failed, 0 not run" in captured.out
        assert "2 request(s) did not succeed (2 of them bad input lines" in captured.err
        records = strict_records(out)  # valid UTF-8, valid JSON, the surrogate id included
        assert len(records) == 9
        ok = {r["id"]: r for r in records if r["error"] is None}
        assert set(ok) == {"g1", "sur\ud800", "g3", "ls", "g5", "g7", "g9"}
        assert all(r["text"] == ANSWER for r in ok.values())
        assert ok["sur\ud800"]["line"] == 2 and b'"id": "sur\\ud800"' in out.read_bytes()
        assert [r.body["messages"][0]["content"] for r in server.requests if r.key == SEPARATORS] == [SEPARATORS]
        errors = sorted((r for r in records if r["error"] is not None), key=lambda r: r["line"])
        assert [(r["id"], r["line"], r["error_type"], r["attempts"]) for r in errors] == [
            (None, 6, "InputError", []), (None, 8, "InputError", [])]
        assert errors[0]["error"] == f"input line 6 has an integer of 5000 digits (at most {MAX_INT_DIGITS})"
        assert errors[1]["error"] == f"input line 8 nests arrays and objects more than {MAX_NESTING} deep"
        assert len(server.requests) == 7  # the bad lines were never sent

        assert main(argv) == 1  # the same command again
        captured = capsys.readouterr()
        assert "7 already done, 2 to run" in captured.err and "7/9 ok, 2 failed" in captured.out
        assert len(server.requests) == 7  # nothing finished was requested again
        again = strict_records(out)
        assert again[:9] == records
        assert sorted((r["line"], r["error_type"]) for r in again[9:]) == [(6, "InputError"), (8, "InputError")]


# -- input -------------------------------------------------------------------------------------------------

def test_jsonl_is_split_on_newline_only(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + chat(1).encode() + b"\r\n"  # a BOM, a CRLF line end
                     + chat(2, SEPARATORS).encode("utf-8") + b"\n"
                     + b'{"id": 3, "prompt": "a\x1cb\x0bc\x0cd"}\n'  # raw control characters: not JSON
                     + b"\n   \n"
                     + chat(6, "last").encode())  # no newline at the end
    items = read_input(path)
    assert [(i.id, i.line_no) for i in items] == [(1, 1), (2, 2), (None, 3), (6, 6)]
    assert items[1].problem is None and items[1].fields["messages"][0]["content"] == SEPARATORS
    assert items[2].problem.startswith("input line 3 is not valid JSON (Invalid control character")
    assert items[3].problem is None and items[3].fields["messages"][0]["content"] == "last"


@pytest.mark.parametrize("line, problem", [
    (b'{"id": "x", "prompt": "p\xff"}', "input line 2 is not valid UTF-8 (byte 0xff at offset 24)"),
    (b'{"id": "x", "prompt": "p"', "input line 2 is not valid JSON (Expecting ',' delimiter at column 26)"),
    (b'{"id": ' + b"1" * 5000 + b', "prompt": "p"}', "input line 2 has an integer of 5000 digits (at most 100)"),
    (b'{"id": "x", "prompt": "p", "seed": -' + b"1" * 101 + b"}",
     "input line 2 has an integer of 101 digits (at most 100)"),
    (b'{"id": "x", "prompt": "p", "n": ' + b"{\"a\": " * 10_000 + b"1" + b"}" * 10_000 + b"}",
     "input line 2 nests arrays and objects more than 100 deep"),
    (b'{"id": "x", "prompt": "p", "temperature": NaN}', "input line 2 has NaN, which is not JSON"),
    (b'{"id": "x", "prompt": "p", "temperature": -Infinity}', "input line 2 has -Infinity, which is not JSON"),
    (b'{"id": "x", "prompt": "p", "temperature": 1e999}', "input line 2 has a number out of range (1e999)"),
    (b'"just a string"', "input line 2 is not a JSON object"),
    (b'{"id": null, "prompt": "p"}', "input line 2 has no id (a non-empty string or an integer)"),
    (b'{"id": "first", "prompt": "again"}', "input line 2 repeats id 'first' of line 1"),
])
def test_a_bad_line_is_an_item_keyed_by_line_with_a_one_line_problem(tmp_path, line, problem):
    path = tmp_path / "in.jsonl"
    path.write_bytes(chat("first").encode() + b"\n" + line + b"\n" + chat("third").encode() + b"\n")
    first, bad, third = read_input(path)
    assert first.problem is None and third.problem is None and third.line_no == 3
    assert (bad.id, bad.line_no, bad.key, bad.endpoint) == (None, 2, "line 2", None)
    assert bad.problem == problem


def test_a_lone_surrogate_in_the_request_is_an_input_error_the_id_is_kept(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "s\\udc00", "prompt": "p\\ud800"}\n{"id": "pair", "prompt": "\\ud83d\\ude00"}\n')
    lone, pair = read_input(path)
    assert lone.id == "s\udc00" and "lone surrogate" in lone.problem and lone.problem.startswith("input line 1:")
    assert pair.problem is None and pair.fields["prompt"] == "\U0001F600"  # a valid pair is one character


def test_integer_and_nesting_bounds_are_inclusive(tmp_path):
    nested = '{"id": 2, "prompt": "p", "n": ' + "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1) + "}"
    lines = [
        '{"id": 1, "prompt": "p", "seed": -' + "9" * MAX_INT_DIGITS + "}",
        nested,  # the line's own object is level 1
        nested.replace('"id": 2', '"id": 3').replace('"n": ', '"n": [', 1).replace("]}", "]]}"),
        '{"id": 4, "prompt": "' + "[" * 500 + '\\"{{{"}',  # brackets inside a string are text
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    items = read_input(path)
    assert items[0].problem is None and items[0].fields["seed"] == -int("9" * MAX_INT_DIGITS)
    assert items[1].problem is None
    assert items[2].problem == f"input line 3 nests arrays and objects more than {MAX_NESTING} deep"
    assert items[3].problem is None and items[3].fields["prompt"] == "[" * 500 + '"{{{'


def test_results_file_lines_past_the_bounds_are_unreadable_not_fatal(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 1, "error": null}\n{"id": ' + b"1" * 5000 + b"}\n"
                     + b'{"id": 2, "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}\n")
    records, unreadable = read_results(path)
    assert [r["id"] for r in records] == [1] and unreadable == 2


# -- results -----------------------------------------------------------------------------------------------

def test_a_lone_surrogate_in_the_server_text_is_written_escaped(tmp_path):
    server = rewriting_server((b'"t1 "', b'"t1 \\ud800"'))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(chat(i, f"q{i}") + "\n" for i in range(4)))
    items = read_input(inp)
    with server:
        first = run(server, items, out, stream=True)
        assert (first.ok, first.failed) == (4, 0)
        records = strict_records(out)
        assert [r["text"] for r in records] == [ANSWER.replace("t1 ", "t1 \ud800")] * 4
        assert out.read_bytes().count(b"t1 \\ud800") == 4
        sent = len(server.requests)
        second = run(server, items, out, stream=True)
        assert (second.pending, second.skipped) == (0, 4) and len(server.requests) == sent


def test_nan_in_a_server_usage_block_is_written_as_null(tmp_path):
    server = rewriting_server((b'"mean_acceptance_length": 2.0', b'"mean_acceptance_length": NaN'))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(chat("a") + "\n")
    with server:
        assert run(server, read_input(inp), out, stream=True).ok == 1
    (record,) = strict_records(out)
    spec = record["usage"]["speculative"]
    assert record["error"] is None and spec["mean_acceptance_length"] is None and spec["drafted_tokens"] == 12


def test_odd_usage_counts_from_the_server_do_not_sink_the_run_or_the_report(tmp_path, capsys):
    server = rewriting_server((b'"completion_tokens": 8', b'"completion_tokens": "many"'),
                              (b'"drafted_tokens": 12', b'"drafted_tokens": [12]'))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(chat("a", "q1") + "\n" + chat("b", "q2 two") + "\n")
    with server:
        argv = ["batch", str(inp), "--out", str(out), "--base-url", server.base_url, "--model", MODEL,
                "--report", str(tmp_path / "report.md")]
        assert main(argv) == 0
        assert main(argv) == 0  # the report is built again from the same lines
    assert "2/2 ok, 0 failed" in capsys.readouterr().out
    assert all(r["usage"]["completion_tokens"] == "many" for r in strict_records(out))  # recorded as sent
    run_doc = json.loads((tmp_path / "report.json").read_text())["runs"][0]
    assert run_doc["tokens"]["completion"] == 0 and run_doc["tokens"]["prompt"] == 1 + 2
    assert run_doc["speculative"]["drafted_tokens"] == 0 and run_doc["speculative"]["accepted_tokens"] == 8


@pytest.mark.parametrize("value, count", [(7, 7), (7.0, 7), (10**400, 10**400), (-1, 0), (True, 0), ("7", 0),
                                          (None, 0), ([7], 0), (float("nan"), 0), (float("inf"), 0)])
def test_usage_count_takes_only_counts(value, count):
    assert batch.usage_count({"completion_tokens": value}, "completion_tokens") == count
    assert batch.usage_count([value], "completion_tokens") == 0


def test_a_result_that_cannot_be_written_becomes_an_error_record(tmp_path, monkeypatch):
    real = batch.success_record

    def unserializable(item, *args):
        record = real(item, *args)
        return {**record, "usage": {"handle": object()}} if item.id == "bad" else record

    monkeypatch.setattr(batch, "success_record", unserializable)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(chat("ok-1", "q1") + "\n" + chat("bad", "q2") + "\n" + chat("ok-2", "q3") + "\n")
    items = read_input(inp)
    with FakeServer(FakeServerConfig()) as server:
        first = run(server, items, out, stream=False)
        assert (first.ok, first.failed) == (2, 1)
        (bad,) = [r for r in strict_records(out) if r["error"] is not None]
        assert (bad["id"], bad["line"], bad["error_type"], bad["text"]) == ("bad", 2, "OutputError", None)
        assert bad["error"] == ("the result of input line 2 cannot be written as JSON "
                                "(TypeError: Object of type object is not JSON serializable)")
        monkeypatch.setattr(batch, "success_record", real)
        second = run(server, items, out, stream=False)
        assert (second.skipped, second.ok, second.failed) == (2, 1, 0)
        keys = [r.key for r in server.requests]
        assert sorted(keys[:3]) == ["q1", "q2", "q3"] and keys[3:] == ["q2"]  # only the failed one again


def test_report_with_a_lone_surrogate_in_a_failure_reason_is_written(tmp_path):
    record = {"id": "a", "line": 1, "error": "server said \ud800", "started_at": 0.0, "finished_at": 1.0}
    doc = build_report([summarize([record])], load_price_table(None), None, model="m\udfff")
    md_path, json_path = write_report(tmp_path / "report.md", doc)
    assert "server said \\ud800" in md_path.read_text(encoding="utf-8")
    assert json.loads(json_path.read_text())["runs"][0]["requests"]["failure_reasons"][0]["reason"] == "server said \ud800"
