"""The batch runner in process, against the fault-injecting server: input parsing, one line per
request, resume semantics, torn-line repair."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from fakes.openai_server import FakeServer, FakeServerConfig
from specdec.client import AsyncClient, RetryPolicy, Timeouts
from specdec.client.batch import (
    BatchItem,
    BatchSettings,
    id_key,
    read_input,
    ResultWriter,
    read_results,
    request_body,
    run_batch,
)
from specdec.client.jsonl import repair_torn_tail
from specdec.types import SpecdecError

pytestmark = pytest.mark.timeout(30)
MODEL = "fake-model"
FAULTS = ["", "[[faults: 429]]", "[[faults: 500, drop]]", "[[always: 400]]", "[[faults: slow]]", "[[always: 503]]",
          "[[faults: 429:0.02, 429:0.02, 429:0.02]]"]


@pytest.fixture
def server():
    with FakeServer(FakeServerConfig(slow_seconds=1.0)) as running:
        yield running


def write_jsonl(path, entries):
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return path


def run(server, items, out, *, concurrency=4, max_attempts=3, total_timeout=0.4, **settings):
    async def no_wait(seconds):
        await asyncio.sleep(0)

    async def main():
        async with AsyncClient(server.base_url, sleep=no_wait, rng=random.Random(0),
                               retry=RetryPolicy(max_attempts=max_attempts), timeouts=Timeouts(total=total_timeout)) as client:
            return await run_batch(client, items, out, BatchSettings(model=MODEL, concurrency=concurrency, **settings))

    return asyncio.run(main())


def lines_by_id(path):
    records, unreadable = read_results(path)
    assert unreadable == 0
    grouped = {}
    for record in records:
        grouped.setdefault(id_key(record["id"]), []).append(record)
    return grouped


# -- input ---------------------------------------------------------------------------------------------

def test_read_input_items_and_problems(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": False},
        "",
        {"id": 7, "prompt": "complete"},
        {"id": "neither"},
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"id": "empty", "messages": []},
    ])
    items = read_input(path)
    assert [i.id for i in items] == ["a", 7, "neither", "both", "empty"]
    assert items[0].endpoint == "chat" and items[0].fields == {"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 5}
    assert items[1].endpoint == "completions" and items[1].line_no == 3
    assert all(i.problem is None for i in items[:2])
    assert "line 4" in items[2].problem and "exactly one of messages or prompt" in items[2].problem
    assert items[3].problem and items[4].problem and items[4].endpoint is None


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "line 1 is not valid JSON"),
    (['{"prompt": "x"}'], "line 1 has no id"),
    (['{"id": true, "prompt": "x"}'], "line 1 has no id"),
    (['[1, 2]'], "line 1 is not a JSON object"),
    (['{"prompt": "x"}', "{", "[]", "7"], "line 3 is not a JSON object; 4 bad lines in all"),
    ([""], "holds no requests"),
])
def test_a_file_with_no_identifiable_line_stops_the_run_with_one_line(tmp_path, lines, message):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecdecError) as info:
        read_input(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_unidentifiable_lines_among_good_ones_become_items_keyed_by_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{not json\n{"id": "a", "prompt": "y"}\n')
    good, broken, repeated = read_input(path)
    assert good.problem is None and good.key == id_key("a")
    assert (broken.id, broken.line_no, broken.key) == (None, 2, "line 2")
    assert broken.problem.startswith("input line 2 is not valid JSON")
    assert repeated.id is None and repeated.problem == "input line 3 repeats id 'a' of line 1"


def test_missing_input_file(tmp_path):
    with pytest.raises(SpecdecError, match="not found"):
        read_input(tmp_path / "nope.jsonl")


def test_ids_1_and_string_1_are_distinct(tmp_path):
    items = read_input(write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}, {"id": "1", "prompt": "b"}]))
    assert len({id_key(i.id) for i in items}) == 2


def test_request_body_merges_run_settings_and_line_fields():
    item = BatchItem("x", 1, "chat", {"messages": [], "max_tokens": 3, "speculative_decoding": False})
    body = request_body(item, BatchSettings(model="m", max_tokens=64, temperature=0.0, speculative="ngram"))
    assert body == {"model": "m", "max_tokens": 3, "temperature": 0.0, "speculative_decoding": False, "messages": []}
    forced = request_body(item, BatchSettings(model="m", speculative="on", force_speculative=True))
    assert forced["speculative_decoding"] is True


# -- running ---------------------------------------------------------------------------------------

def test_every_request_ends_ok_or_recorded_nothing_duplicated(tmp_path, server):
    entries = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i} {FAULTS[i % len(FAULTS)]}"}]}
               for i in range(28)]
    entries.append({"id": "bad-line", "prompt": 5})
    items = read_input(write_jsonl(tmp_path / "in.jsonl", entries))
    out = tmp_path / "out.jsonl"
    outcome = run(server, items, out, stream=True, max_attempts=4)
    grouped = lines_by_id(out)
    assert set(grouped) == {id_key(i.id) for i in items}
    assert all(len(lines) == 1 for lines in grouped.values())  # one line per request in one run
    assert outcome.ok + outcome.failed == len(items) and outcome.skipped == 0
    for i, entry in enumerate(entries[:-1]):
        (record,) = grouped[id_key(entry["id"])]
        fault = FAULTS[i % len(FAULTS)]
        if "always" in fault:
            assert record["error"] and record["text"] is None and record["error_type"] in ("BadRequestError",
                                                                                            "InternalServerError")
        else:
            assert record["error"] is None and record["text"] == "t0 t1 t2 t3 t4 t5 t6 t7 "
            assert record["usage"]["speculative"]["method"] == "ngram"
            assert record["ttft_seconds"] is not None and record["latency_seconds"] >= record["ttft_seconds"]
        for key in ("id", "text", "usage", "latency_seconds", "ttft_seconds", "attempts", "error"):
            assert key in record
    bad = grouped[id_key("bad-line")][0]
    assert bad["error_type"] == "InputError" and bad["attempts"] == []
    # The server saw exactly the attempts the records hold: nothing sent twice behind our back.
    assert sum(len(r[0]["attempts"]) for r in grouped.values()) == len(server.requests)


def test_rerun_skips_done_and_retries_failed(tmp_path, server):
    entries = [{"id": i, "prompt": f"p{i}" + (" [[faults: 500, 500, 500]]" if i % 3 == 0 else "")} for i in range(9)]
    items = read_input(write_jsonl(tmp_path / "in.jsonl", entries))
    out = tmp_path / "out.jsonl"
    first = run(server, items, out, max_attempts=2, stream=False)
    assert (first.ok, first.failed) == (6, 3)
    sent = len(server.requests)
    second = run(server, items, out, max_attempts=2, stream=False)
    assert (second.skipped, second.ok, second.failed) == (6, 3, 0)
    assert len(server.requests) == sent + 3 * 2 - 0  # only the failed ids were sent again (500, then ok)
    grouped = lines_by_id(out)
    for key, lines in grouped.items():
        assert sum(line["error"] is None for line in lines) == 1
    third = run(server, items, out)
    assert (third.pending, third.skipped) == (0, 9)


def test_torn_last_line_is_repaired_before_appending(tmp_path, server):
    items = read_input(write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(4)]))
    out = tmp_path / "out.jsonl"
    run(server, items[:2], out, stream=False)
    good = out.read_bytes()
    torn = json.dumps({"id": 2, "text": "t0", "error": None})[:25]
    out.write_bytes(good + torn.encode())  # killed while writing id 2's success line
    assert read_results(out)[1] == 1  # the report side tolerates it
    run(server, items, out, stream=False)
    data = out.read_bytes()
    assert data.startswith(good) and data.endswith(b"\n") and torn.encode() not in data
    grouped = lines_by_id(out)
    assert sorted(grouped) == sorted(id_key(i) for i in range(4))
    assert all(len(lines) == 1 for lines in grouped.values())


def test_repair_torn_tail_cases(tmp_path):
    path = tmp_path / "r.jsonl"
    assert repair_torn_tail(path) == 0  # missing file
    path.write_bytes(b"")
    assert repair_torn_tail(path) == 0
    path.write_bytes(b'{"id": 1}\n')
    assert repair_torn_tail(path) == 0 and path.read_bytes() == b'{"id": 1}\n'
    path.write_bytes(b'{"id": 1}\n{"id": 2, "te')
    assert repair_torn_tail(path) == 13 and path.read_bytes() == b'{"id": 1}\n'
    path.write_bytes(b'{"id": 1, "te')  # the very first line torn
    assert repair_torn_tail(path) == 13 and path.read_bytes() == b""
    long_line = b'{"id": 1}\n' + b"x" * 200_000  # a torn line longer than one read block
    path.write_bytes(long_line)
    assert repair_torn_tail(path) == 200_000 and path.read_bytes() == b'{"id": 1}\n'


def test_concurrency_is_respected(tmp_path, server):
    server.config.token_delay = 0.01
    items = read_input(write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(12)]))
    run(server, items, tmp_path / "out.jsonl", concurrency=3, stream=True, speculative="off")
    assert server.app.state.peak_in_flight == 3 and server.app.state.in_flight == 0


def test_two_runs_cannot_share_a_results_file(tmp_path, server):
    items = read_input(write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "p"}]))
    holder = ResultWriter(tmp_path / "out.jsonl")
    try:
        with pytest.raises(SpecdecError, match="another batch is writing"):
            run(server, items, tmp_path / "out.jsonl")
    finally:
        holder.close()
    assert run(server, items, tmp_path / "out.jsonl").ok == 1
