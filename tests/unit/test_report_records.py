"""The pieces every report and every record file share: the spread of a list of numbers, table
cells, the timing of a token stream, and one request record written in each file's layout."""
import pytest

from specdec.bench.records import RECORD_LAYOUT, bench_record
from specdec.client.batch import RESULTS_LAYOUT
from specdec.client.records import RequestRecord, stream_timing
from specdec.client.render import NEAREST_RANK, Cells, fields, markdown_table, spread


def test_spread_of_four_values():
    s = spread([40, 10, 30, 20])
    assert (s.count, s.mean, s.median, s.min, s.max) == (4, 25.0, 25.0, 10.0, 40.0)
    assert (s.p25, s.p50, s.p75) == (17.5, 25.0, 32.5)
    assert s.p95 == pytest.approx(38.5) and s.p99 == pytest.approx(39.7)
    hundred = spread([float(v) for v in range(1, 101)])
    assert hundred.p95 == pytest.approx(95.05) and hundred.p99 == pytest.approx(99.01)
    assert spread([]) is None
    assert fields(None, ("p50", "max")) == {"p50": None, "max": None}


def test_nearest_rank_spread_reports_values_that_occurred_and_the_true_median():
    s = spread([40, 10, 30, 20], NEAREST_RANK)
    # ranks 0.75, 1.5 and 2.25 of 0..3 round to 1, 2 (half to even) and 2
    assert (s.p25, s.p50, s.p75, s.p95) == (20.0, 30.0, 30.0, 40.0)
    assert s.median == 25.0


def test_cells():
    dash, na = Cells(), Cells(missing="n/a")
    assert dash.number(1.234) == "1.23" and dash.number(2, ".1f", "×") == "2.0×" and dash.number(None) == "—"
    assert na.number(None) == "n/a" and na.number(0.12345, ".3f") == "0.123"
    assert dash.span(1, 2.5) == "1.00–2.50" and dash.span(None, None) == "—"
    assert na.change(-0.25) == "-25.0 %" and na.change(0.1) == "+10.0 %" and na.change(None) == "n/a"
    assert na.usd(1234.5) == "$1,234.50" and na.usd(0.0012) == "$0.001200" and na.usd(None) == "n/a"
    assert markdown_table(["a", ""], [[1, "x"]]) == ["| a | |", "|---|---|", "| 1 | x |"]


def test_stream_timing_worked_example():
    # started 10.0; chunks at 10.5 (1 token), 10.7 (2) and 11.5 (3); 6 tokens in all
    timing = stream_timing([(10.5, 1), (10.7, 2), (11.5, 3)], 10.0, 6)
    assert timing.ttft_seconds == pytest.approx(0.5)
    assert timing.decode_tokens_per_second == pytest.approx(5.0)  # (6 - 1) tokens / (11.5 - 10.5) s
    # a first chunk of 4 tokens leaves 2 for the decode rate: 2 / 0.5 s
    assert stream_timing([(1.0, 4), (1.5, 2)], 0.0, 6).decode_tokens_per_second == pytest.approx(4.0)
    one_chunk = stream_timing([(10.25, 3)], 10.0, 3)
    assert (one_chunk.ttft_seconds, one_chunk.decode_tokens_per_second) == (0.25, None)
    assert (stream_timing([], 10.0, 0).ttft_seconds, stream_timing([], 10.0, 0).decode_tokens_per_second) == (None, None)


def test_a_batch_line_round_trips_and_keeps_its_keys_in_order():
    line = {"id": "a", "line": 3, "text": "hi", "usage": {"completion_tokens": 2}, "latency_seconds": 1.5,
            "ttft_seconds": 0.2, "attempts": [], "error": None, "error_type": None, "model": "m",
            "finish_reason": "stop", "speculative_decoding": True, "started_at": 100.0, "finished_at": 101.5,
            "schema_valid": None}
    record = RequestRecord.from_dict(line, RESULTS_LAYOUT)
    assert (record.text, record.wall_seconds, record.ttft_seconds, record.started_at) == ("hi", 1.5, 0.2, 100.0)
    assert record.succeeded and record.fields["usage"] == {"completion_tokens": 2}
    written = record.as_dict(RESULTS_LAYOUT)
    assert written == line and list(written) == list(line)


def test_a_bench_line_is_written_in_the_records_file_layout_and_reads_back():
    measured = RequestRecord(text="x", prompt_tokens=5, finish_reason="length", wall_seconds=0.5,
                             stats={"tokens_per_second": 20.0}, fields={"output_token_ids": [1, 2]})
    identity = {"source": "specdec", "prompt_id": "7", "category": "qa", "config": "off", "method": "off",
                "num_draft_tokens": 0, "repeat": 1, "matches_off": None, "order": 0}
    line = bench_record(measured, identity, started_at=1_800_000_000.0)
    assert list(line) == ["source", "prompt_id", "category", "config", "method", "num_draft_tokens", "repeat", "success",
                          "error", "prompt_tokens", "output_token_ids", "text", "finish_reason", "wall_seconds", "stats",
                          "matches_off", "order", "started_at"]
    assert line["success"] is True and line["output_token_ids"] == [1, 2]
    assert line["started_at"] == "2027-01-15T08:00:00+00:00"
    back = RequestRecord.from_dict(line, RECORD_LAYOUT)
    assert back.started_at == 1_800_000_000.0 and back.stats == {"tokens_per_second": 20.0}
    assert back.as_dict(RECORD_LAYOUT) == line
    failed = bench_record(RequestRecord(error="boom"), identity, started_at=0.0)
    assert (failed["success"], failed["output_token_ids"], failed["text"]) == (False, [], None)
