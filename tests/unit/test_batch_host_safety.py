"""The batch host holds against its own input: a schema's `$ref` reaches no URL and no file, a
validator that cannot check a schema makes that line's output invalid (with the reason) instead of
ending the run, an unclosed string of escaped quotes is scanned in linear time, and `--out` (or
`--report`) naming the input file is refused before anything is written."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fakes.openai_server import FakeServer, FakeServerConfig
from specdec.cli import main
from specdec.client import structured
from specdec.client.batch import BatchSettings, read_input, read_results, run_batch
from specdec.client.http import Completion
from specdec.client.structured import check_output

pytestmark = pytest.mark.timeout(30)
MODEL = "fake-model"
OBJECT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def form(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


class StubClient:
    """Answers every request with the same text, as a server that enforced the schema would."""

    def __init__(self, text):
        self.text, self.bodies = text, []

    async def create(self, endpoint, body, stream=True):
        self.bodies.append(body)
        return Completion(self.text, "stop", None, MODEL, 0.01, None)


def run_lines(tmp_path, lines, text):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    client = StubClient(text)
    outcome = asyncio.run(run_batch(client, read_input(inp), out, BatchSettings(model=MODEL, concurrency=2)))
    records, unreadable = read_results(out)
    assert unreadable == 0
    return outcome, {r["id"]: r for r in records}


@pytest.fixture
def schema_host():
    """An HTTP server that would serve a schema accepting the output, counting its requests."""
    hits = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = json.dumps({"type": "object"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()


# -- $ref: the schema itself, nothing else ------------------------------------------------------------------

def test_a_remote_ref_is_not_fetched(schema_host):
    base, hits = schema_host
    for schema in ({"$ref": f"{base}/s.json"}, {"$id": f"{base}/root.json", "$ref": "other.json"},
                   {"$defs": {"x": {"$dynamicRef": f"{base}/d.json"}}, "$ref": "#/$defs/x"}):
        valid, why = check_output('{"name": "a"}', form(schema))
        assert valid is False and "is not in the schema (remote and file references are not followed)" in why
    assert hits == []


def test_a_file_ref_is_not_read(tmp_path):
    accepting = tmp_path / "schema.json"
    accepting.write_text(json.dumps({"type": "object"}))
    for schema in ({"$ref": accepting.as_uri()}, {"$id": tmp_path.as_uri() + "/", "$ref": "schema.json"}):
        valid, why = check_output('{"name": "a"}', form(schema))
        assert (valid, why) == (False, f"$ref {schema['$ref']!r} is not in the schema "
                                       "(remote and file references are not followed)")


def test_local_refs_still_resolve():
    schema = {"$id": "https://example.com/root.json", "$defs": {"o": OBJECT_SCHEMA}, "$ref": "#/$defs/o"}
    assert check_output('{"name": "a"}', form(schema)) == (True, None)
    assert check_output('{"name": 1}', form(schema)) == (False, None)
    embedded = {"$id": "https://example.com/root", "properties": {"a": {"$ref": "item"}, "b": {"$ref": "#it"}},
                "$defs": {"i": {"$id": "https://example.com/item", "type": "integer"},
                          "s": {"$anchor": "it", "type": "string"}}}
    assert check_output('{"a": 1, "b": "x"}', form(embedded)) == (True, None)
    assert check_output('{"a": "x"}', form(embedded)) == (False, None)
    assert check_output('{"name": 1}', form({"$ref": "https://json-schema.org/draft/2020-12/schema"})) == (True, None)


def test_a_line_with_a_remote_ref_is_an_invalid_output_the_run_goes_on(tmp_path, schema_host):
    base, hits = schema_host
    lines = [{"id": "remote", "prompt": "p", "response_format": form({"$ref": f"{base}/s.json"})},
             {"id": "plain", "prompt": "p", "response_format": form(OBJECT_SCHEMA)}]
    outcome, records = run_lines(tmp_path, lines, '{"name": "a"}')
    assert (outcome.ok, outcome.failed) == (2, 0) and hits == []
    assert records["remote"]["schema_valid"] is False and f"{base}/s.json" in records["remote"]["schema_error"]
    assert records["plain"]["schema_valid"] is True and "schema_error" not in records["plain"]


# -- a validator that cannot check a schema ---------------------------------------------------------------

def test_unicode_property_patterns_are_read_with_regex():
    pytest.importorskip("regex")
    letters = form({"type": "object", "properties": {"w": {"type": "string", "pattern": r"^\p{L}+$"}},
                    "patternProperties": {r"^\p{Lu}$": {"type": "integer"}}, "additionalProperties": False})
    assert check_output('{"w": "été", "É": 1}', letters) == (True, None)
    assert check_output('{"w": "été1"}', letters) == (False, None)
    assert check_output('{"É": "x"}', letters) == (False, None)  # a pattern property's schema applies
    assert check_output('{"1": 1}', letters) == (False, None)  # matches no pattern: an additional property


@pytest.mark.parametrize("schema, why", [
    ({"type": "string", "pattern": r"^\p{L}+$"}, "a pattern in the schema cannot be read (bad escape \\p at position 1)"),
    ({"type": 5}, "the schema cannot be checked (TypeError: 'int' object is not iterable)"),
])
def test_a_schema_the_validator_cannot_check_makes_the_output_invalid(monkeypatch, schema, why):
    monkeypatch.setattr(structured, "_regex", None)  # as where the regex package is not installed
    assert check_output('"été"', form(schema)) == (False, why)


def test_a_pattern_python_cannot_read_does_not_end_the_run_or_its_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(structured, "_regex", None)
    lines = [{"id": 1, "prompt": "p", "response_format": form({"type": "string", "pattern": r"^\p{L}+$"})},
             {"id": 2, "prompt": "p", "response_format": form({"type": "string"})}]
    outcome, records = run_lines(tmp_path, lines, '"été"')
    assert (outcome.ok, outcome.failed) == (2, 0)
    assert records[1]["schema_valid"] is False and records[1]["schema_error"].startswith("a pattern in the schema")
    assert records[2]["schema_valid"] is True
    again, _ = run_lines(tmp_path, lines, '"été"')
    assert (again.pending, again.skipped) == (0, 2)


# -- the input scan --------------------------------------------------------------------------------------

@pytest.mark.timeout(5)  # the old scan restarted at every quote: about a minute for this line
def test_an_unclosed_string_of_escaped_quotes_is_scanned_in_linear_time(tmp_path):
    pairs = 60_000
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "ok"}\n'
                     + b'{"id": 2, "prompt": "' + b'\\"' * pairs + b"\n"  # no closing quote
                     + b'{"id": 3, "prompt": "' + b'\\"' * pairs + b'"}\n')
    started = time.monotonic()
    first, unclosed, closed = read_input(path)
    assert first.problem is None and closed.problem is None and closed.fields["prompt"] == '"' * pairs
    assert unclosed.problem == "input line 2 is not valid JSON (Unterminated string starting at at column 21)"
    assert time.monotonic() - started < 5


# -- --out is not the input ------------------------------------------------------------------------------

def _same_as_input(tmp_path, how):
    """(extra argv naming the input file as an output, the file that must stay untouched)."""
    inp = tmp_path / "in.jsonl"
    if how == "same path":
        return ["--out", str(inp)]
    if how == "dot-dot":
        (tmp_path / "sub").mkdir()
        return ["--out", str(tmp_path / "sub" / ".." / "in.jsonl")]
    if how == "symlink":
        os.symlink(inp, tmp_path / "link.jsonl")
        return ["--out", str(tmp_path / "link.jsonl")]
    if how == "hard link":
        os.link(inp, tmp_path / "hard.jsonl")
        return ["--out", str(tmp_path / "hard.jsonl")]
    if how == "compare":  # --compare writes RES.off.jsonl and RES.on.jsonl
        os.symlink(inp, tmp_path / "res.on.jsonl")
        return ["--out", str(tmp_path / "res.jsonl"), "--compare"]
    assert how == "report"  # --report r.md writes r.json beside it
    os.symlink(inp, tmp_path / "r.json")
    return ["--out", str(tmp_path / "out.jsonl"), "--report", str(tmp_path / "r.md")]


@pytest.mark.parametrize("how", ["same path", "dot-dot", "symlink", "hard link", "compare", "report"])
def test_out_naming_the_input_is_refused_before_anything_is_written(tmp_path, capsys, how):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "q", "prompt": "p"}) + "\n")
    before = inp.read_bytes()
    argv = _same_as_input(tmp_path, how)
    with FakeServer(FakeServerConfig()) as server:
        rc = main(["batch", str(inp), "--base-url", server.base_url, "--model", MODEL, "--no-progress", *argv])
        assert server.requests == []
    err = capsys.readouterr().err
    assert rc == 2 and inp.read_bytes() == before
    assert err.count("\n") == 1 and "is the input file" in err and err.startswith("specdec: error: --")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "r.md").exists()
