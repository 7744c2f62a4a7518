"""`specdec bench --server` (bench/serving.py) through HTTP against a server on the fake backend:
every prompt at every level, records per request, and texts compared with one stream's."""
import json

import pytest

from specdec.backends.fake import FakeBackend
from specdec.bench import serving
from specdec.bench.datasets import BenchPrompt
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(120)

PROMPTS = [BenchPrompt(str(i), "cat" if i % 2 else "dog", ({"role": "user", "content": f"the cat sat {i}"},))
           for i in range(4)]


def test_every_prompt_runs_at_every_level_and_the_report_compares_texts(tmp_path):
    app = create_app(Engine(FakeBackend(seed=7), n_slots=4), ServerConfig(served_model_name="fake",
                                                                          spec=SpecConfig("ngram", 3)))
    engine = Engine(FakeBackend(seed=7))
    with serve_in_thread(app) as (url, _):
        configs = [serving.ServedConfig("specdec:off", url, "off", serving.served_model(url)),
                   serving.ServedConfig("specdec:ngram", url, "ngram", "fake"),
                   serving.ServedConfig("engine:off", "", "off", engine=engine)]
        records = serving.run_levels(configs, PROMPTS, [1, 2, 4], 24, 2, tmp_path / "records.jsonl",
                                     progress=lambda line: None)
    assert all(r["error"] is None for r in records)
    http = [r for r in records if r["config"].startswith("specdec")]
    assert len(http) == 2 * 3 * 2 * len(PROMPTS)  # configs x levels x repeats x prompts
    assert len([r for r in records if r["config"] == "engine:off"]) == 2 * len(PROMPTS)  # one stream only
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == len(records)
    rows = serving.summarize(records, configs, [1, 2, 4])
    by = {(row["config"], row["level"]): row for row in rows}
    for level in (1, 2, 4):
        assert by[("specdec:off", level)]["texts_as_one_stream"] == "8/8"
        assert by[("specdec:ngram", level)]["aggregate_tokens_per_second"] > 0
    assert ("engine:off", 2) not in by
    # greedy: the server's texts are the engine's
    engine_texts = {r["prompt_id"]: r["text"] for r in records if r["config"] == "engine:off"}
    assert all(r["text"] == engine_texts[r["prompt_id"]] for r in http)
    table = serving.format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| specdec:ngram | 4 |" in table
    json.dumps(rows)  # the report is JSON


def test_a_refused_request_is_a_record_with_its_error(tmp_path):
    app = create_app(Engine(FakeBackend(seed=7)), ServerConfig(served_model_name="fake"))
    with serve_in_thread(app) as (url, _):
        config = serving.ServedConfig("specdec:off", url, "off", "not-this-model")
        records = serving.run_levels([config], PROMPTS[:1], [1], 8, 1, tmp_path / "r.jsonl", progress=lambda line: None)
    assert records[0]["error"].startswith("HTTP 404")
    assert serving.summarize(records, [config], [1])[0]["errors"] == 1
