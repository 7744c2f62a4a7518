"""`specdec bench --server --request-rate` (bench/rates.py): Poisson schedules, sweeps, goodput,
per-request TPOT and ITL, the flags, and whole runs against a server on the fake backend."""
import argparse
import json
import math

import pytest

from specdec.backends.fake import FakeBackend
from specdec.bench import cli, rates, serving
from specdec.bench.datasets import BenchPrompt
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecdecError

pytestmark = pytest.mark.timeout(120)

PROMPTS = [BenchPrompt(str(i), "cat", ({"role": "user", "content": f"the cat sat {i}"},)) for i in range(3)]


# -- schedules ---------------------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_the_rate():
    offsets = rates.poisson_offsets(4.0, 4000, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(offsets) == 4000
    assert offsets == rates.poisson_offsets(4.0, 4000, seed=3)
    assert offsets != rates.poisson_offsets(4.0, 4000, seed=4)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.25 * math.log(2), rel=0.1)  # exponential: median ln2/rate


def test_inf_sends_everything_at_once():
    assert rates.poisson_offsets(math.inf, 5, seed=0) == [0.0] * 5


def test_a_sweep_spaces_its_rates_evenly_up_to_saturation():
    assert rates.sweep_rates(10.0, 4) == [2.5, 5.0, 7.5, 10.0]
    assert rates.sweep_rates(3.0, 1) == [3.0]


@pytest.mark.parametrize("value, plan", [
    ("1,2.5,inf", rates.RatePlan(rates=(1.0, 2.5, math.inf))),
    (" 2 , 2 ", rates.RatePlan(rates=(2.0,))),
    ("sweep", rates.RatePlan(sweep=rates.DEFAULT_SWEEP)),
    ("sweep:3", rates.RatePlan(sweep=3)),
])
def test_request_rate_values(value, plan):
    assert rates.parse_request_rate(value) == plan


@pytest.mark.parametrize("value", ["", "0", "-1", "fast", "nan", "sweep:0", "sweep:x", "sweep3", "sweep:"])
def test_bad_request_rates_are_refused(value):
    with pytest.raises(SpecdecError, match="--request-rate"):
        rates.parse_request_rate(value)


def test_rate_labels():
    assert [rates.rate_label(r) for r in (math.inf, 2.5, 3.14159, 10.0)] == ["inf", "2.5", "3.14", "10"]


# -- goodput and per-request figures -----------------------------------------------------------------

def test_goodput_slos_in_milliseconds():
    assert rates.parse_goodput(["ttft:500", "TPOT:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert rates.parse_goodput([]) == {}


@pytest.mark.parametrize("values", [["latency:5"], ["ttft"], ["ttft:soon"], ["ttft:0"], ["ttft:-3"], ["ttft:inf"],
                                    ["ttft:1", "ttft:2"]])
def test_bad_goodput_is_refused(values):
    with pytest.raises(SpecdecError, match="--goodput"):
        rates.parse_goodput(values)


def test_time_per_output_token_is_the_time_after_the_first_over_the_tokens_after_it():
    assert rates.time_per_output_token(2.0, 0.5, 4) == pytest.approx(0.5)
    assert rates.time_per_output_token(2.0, 0.5, 1) is None
    assert rates.time_per_output_token(None, 0.5, 4) is None


def _record(config="c", ttft=0.1, seconds=1.0, tokens=10, gaps=(0.1, 0.1), error=None, repeat=0, rate="2"):
    return {"config": config, "rate": rate, "request_rate": None if rate == "inf" else float(rate), "repeat": repeat,
            "run_seconds": 4.0, "error": error, "ttft": ttft, "seconds": seconds, "tokens": tokens,
            "chunk_gaps": list(gaps), "tpot": rates.time_per_output_token(seconds, ttft, tokens)}


def test_goodput_counts_only_requests_within_every_slo():
    records = [_record(),  # tpot 0.1 s, e2el 1 s: good
               _record(ttft=0.1, seconds=2.8, tokens=10),  # tpot 0.3 s: misses the TPOT SLO only
               _record(ttft=0.9),  # misses TTFT
               _record(error="HTTP 500"),  # failed
               _record(ttft=0.2, seconds=0.2, tokens=1)]  # one token: TPOT counts 0
    slos = rates.parse_goodput(["ttft:500", "tpot:200", "e2el:3000"])
    assert [rates.meets_slos(r, slos) for r in records] == [True, False, False, False, True]
    row, = rates.summarize(records, slos)
    assert row["good_requests"] == 2 and row["goodput"] == pytest.approx(2 / 4.0)
    assert row["requests"] == 5 and row["errors"] == 1 and row["request_throughput"] == pytest.approx(4 / 4.0)
    assert row["output_tokens_per_second"] == pytest.approx(31 / 4.0)
    assert row["slos_ms"] == {"ttft": 500.0, "tpot": 200.0, "e2el": 3000.0}
    assert rates.summarize(records, {})[0]["goodput"] is None


def test_the_row_summarizes_ttft_tpot_itl_and_e2el_in_milliseconds():
    records = [_record(ttft=0.1 * i, seconds=1.0 + 0.1 * i, tokens=11, gaps=(0.01 * i, 0.02 * i)) for i in range(1, 11)]
    row, = rates.summarize(records, {})
    assert row["ttft_ms_mean"] == pytest.approx(550) and row["ttft_ms_median"] == pytest.approx(550)
    assert row["ttft_ms_p90"] == pytest.approx(910) and row["ttft_ms_p99"] == pytest.approx(991)
    assert row["tpot_ms_mean"] == pytest.approx(100)  # (e2e - ttft) / 10 = 1.0 s / 10 for every request
    assert row["itl_ms_mean"] == pytest.approx(82.5)  # the 20 chunk gaps
    assert row["e2el_ms_p90"] == pytest.approx(1910)


def test_rows_follow_the_configurations_then_the_rates_inf_last():
    records = [_record("b", rate="inf"), _record("b", rate="5"), _record("a", rate="0.5"),
               _record("b", rate="10"), _record("b", rate="5", repeat=1)]
    rows = rates.summarize(records, {})
    assert [(r["config"], r["rate"]) for r in rows] == [("b", "5"), ("b", "10"), ("b", "inf"), ("a", "0.5")]
    assert rows[0]["duration_seconds"] == 8.0 and rows[0]["requests"] == 2  # two repeats pooled


# -- flags -------------------------------------------------------------------------------------------

def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flags_and_their_defaults():
    args = _args("--server", "--request-rate", "1,inf", "--goodput", "ttft:500", "--goodput", "tpot:50")
    assert (args.request_rate, args.num_requests, args.warmup_requests) == ("1,inf", 100, 4)
    assert args.goodput == ["ttft:500", "tpot:50"]
    assert _args().request_rate is None


@pytest.mark.parametrize("argv, message", [
    (("--request-rate", "1"), "add --server"),
    (("--server", "--request-rate", "1", "--engine-baseline"), "--engine-baseline"),
    (("--server", "--request-rate", "1", "--goodput", "ttft=500"), "--goodput"),
    (("--server", "--request-rate", "often"), "--request-rate"),
    (("--server", "--request-rate", "1", "--num-requests", "0"), "--num-requests"),
])
def test_bad_runs_are_refused_before_any_server_starts(monkeypatch, argv, message):
    monkeypatch.setattr(serving, "SpecdecServer", None)  # never reached
    with pytest.raises(SpecdecError, match=message):
        cli.run(_args(*argv))


def test_the_server_queues_every_request_unless_told_otherwise():
    assert rates.with_queue(["--inexact"], 104) == ["--inexact", "--max-queue", "104"]
    assert rates.with_queue(["--max-queue", "8"], 104) == ["--max-queue", "8"]
    assert rates.with_queue(["--max-queue=8"], 104) == ["--max-queue=8"]


# -- whole runs on the fake backend ------------------------------------------------------------------

def _app(slots=4):
    return create_app(Engine(FakeBackend(seed=7), n_slots=slots), ServerConfig(served_model_name="fake"))


def test_rates_against_a_fake_server(tmp_path):
    with serve_in_thread(_app()) as (url, _):
        configs = [serving.ServedConfig("specdec:off", url, "off", "fake"),
                   serving.ServedConfig("specdec:ngram", url, "ngram", "fake")]
        records = rates.run_rates(configs, PROMPTS, rates.RatePlan(rates=(50.0, math.inf)), 16, 6, 2, 2, 0,
                                  tmp_path / "r.jsonl", progress=lambda line: None)
    assert len(records) == 2 * 2 * 2 * 6  # configs x rates x repeats x requests; the warm-up unrecorded
    assert all(r["error"] is None for r in records)
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == len(records)
    first = [r for r in records if r["config"] == "specdec:off" and r["rate"] == "50" and r["repeat"] == 0]
    assert [r["index"] for r in first] == list(range(6))
    assert [r["prompt_id"] for r in first] == ["0", "1", "2", "0", "1", "2"]
    offsets = rates.poisson_offsets(50.0, 6, 0)
    assert all(r["sent"] >= offset - 0.01 for r, offset in zip(first, offsets))  # never early
    assert all(r["sent"] <= r["ended"] <= r["run_seconds"] for r in records)
    for r in records:
        if r["tokens"] > 1:
            assert r["tpot"] == pytest.approx((r["seconds"] - r["ttft"]) / (r["tokens"] - 1))
    rows = rates.summarize(records, rates.parse_goodput(["e2el:60000"]))
    assert [(r["config"], r["rate"], r["requests"]) for r in rows] == [
        ("specdec:off", "50", 12), ("specdec:off", "inf", 12), ("specdec:ngram", "50", 12), ("specdec:ngram", "inf", 12)]
    for row in rows:
        assert row["errors"] == 0 and row["request_throughput"] > 0 and row["output_tokens_per_second"] > 0
        assert row["goodput"] == pytest.approx(row["request_throughput"])  # a minute: every request is good
        assert all(row[f"{metric}_ms_{stat}"] is not None for metric in ("ttft", "tpot", "e2el") for stat in rates.STATS)
    table = rates.format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| specdec:ngram | inf | 12 | 0 |" in table
    json.dumps(rows)


def test_a_sweep_measures_saturation_first_then_rates_up_to_it(tmp_path):
    with serve_in_thread(_app()) as (url, _):
        config = serving.ServedConfig("specdec:off", url, "off", "fake")
        records = rates.run_rates([config], PROMPTS, rates.RatePlan(sweep=2), 8, 4, 0, 2, 0,
                                  tmp_path / "r.jsonl", progress=lambda line: None)
    runs = list(dict.fromkeys((r["repeat"], r["rate"]) for r in records))
    assert runs[0] == (0, "inf") and len(runs) == 6  # repeat 0: inf, then 2 rates; repeat 1: 2 rates and inf
    saturated = [r for r in records if r["repeat"] == 0 and r["rate"] == "inf"]
    saturation = len(saturated) / saturated[0]["run_seconds"]
    swept = sorted({r["request_rate"] for r in records if r["request_rate"] is not None})
    assert swept == pytest.approx([saturation / 2, saturation])
    assert [r for _, r in runs[3:]] == [rates.rate_label(saturation / 2), rates.rate_label(saturation), "inf"]


class FakeSpecdecServer:
    """serving.SpecdecServer's place: the app on the fake backend in a thread; the flags kept."""
    started: list = []

    def __init__(self, slots, extra_args, log_path):
        self.slots, self.extra_args = slots, list(extra_args)
        self._serving = serve_in_thread(_app(slots))

    def __enter__(self):
        self.url, _ = self._serving.__enter__()
        FakeSpecdecServer.started.append(self)
        return self

    def __exit__(self, *exc):
        self._serving.__exit__(None, None, None)


def test_the_command_writes_records_and_reports_beside_the_waves(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "SpecdecServer", FakeSpecdecServer)
    monkeypatch.setattr(cli, "_model_paths", lambda args, need_draft: ("target.gguf", None))
    FakeSpecdecServer.started = []
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"the cat sat {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    assert cli.run(_args("--server", "--dataset", str(dataset), "--methods", "off,ngram", "--concurrency", "1,4",
                         "--request-rate", "40,inf", "--num-requests", "5", "--warmup-requests", "1",
                         "--max-tokens", "12", "--goodput", "ttft:60000", "--out", str(out))) == 0
    server, = FakeSpecdecServer.started
    assert server.slots == 4 and server.extra_args == ["--max-queue", "6"]
    rows = json.loads((out / rates.REPORT_JSON).read_text())
    assert [(r["config"], r["rate"], r["requests"], r["errors"]) for r in rows] == [
        ("specdec:off", "40", 5, 0), ("specdec:off", "inf", 5, 0), ("specdec:ngram", "40", 5, 0),
        ("specdec:ngram", "inf", 5, 0)]
    assert all(r["goodput"] == pytest.approx(r["request_throughput"]) for r in rows)
    assert len((out / rates.RECORDS_FILE).read_text().splitlines()) == 20
    report = (out / rates.REPORT_MD).read_text()
    assert report.startswith("Goodput SLOs: ttft <= 60000 ms.") and "| specdec:ngram | 40 | 5 | 0 |" in report
    meta = json.loads((out / rates.META_FILE).read_text())
    assert meta["num_requests"] == 5 and meta["slots"] == 4 and meta["goodput_slos_ms"] == {"ttft": 60000.0}


def test_the_waves_still_run_through_the_same_servers(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "SpecdecServer", FakeSpecdecServer)
    rows = serving.run(PROMPTS[:2], ["off"], [1, 2], 8, 1, tmp_path, [], None, [], "target.gguf", None)
    assert [(r["config"], r["level"], r["requests"], r["errors"]) for r in rows] == [
        ("specdec:off", 1, 2, 0), ("specdec:off", 2, 2, 0)]
    assert (tmp_path / "server-report.md").exists()
