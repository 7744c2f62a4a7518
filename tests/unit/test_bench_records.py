"""The record file survives a crash: records are on disk as they are produced, a torn last line
is dropped on resume, and --resume measures exactly the (prompt, configuration, repeat) missing."""
import argparse
import json

import pytest

from specdec.backends.fake import FakeBackend
from specdec.bench.cli import add_arguments, run_bench
from specdec.bench.records import RecordFile, read_records, record_key
from specdec.engine.engine import Engine
from specdec.types import SpecdecError

PROMPTS = [{"id": f"p{i}", "prompt": f"the cat sat on mat {i}", "category": "c" + str(i % 2)} for i in range(4)]


class Crash(BaseException):
    """Stands for the process dying (not an Exception: the runner must not record it)."""


class Recording:
    def __init__(self, crash_after=None):
        self.engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6))
        self.crash_after = crash_after
        self.generated = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, request):
        if self.crash_after is not None and len(self.generated) >= self.crash_after:
            raise Crash()
        self.generated.append(request.spec.method)
        return self.engine.generate(request)


def args_for(tmp_path, *extra):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--dataset", str(data), "--out", str(tmp_path / "out"), "--max-tokens", "12",
                              "--methods", "off,ngram,draft", "--warmup", "0", "--no-progress", *extra])


def keys(path):
    return [record_key(json.loads(line)) for line in path.read_text().splitlines()]


def test_resume_after_a_crash_with_a_torn_last_line(tmp_path):
    path = tmp_path / "out" / "records.jsonl"
    crashing = Recording(crash_after=5)
    with pytest.raises(Crash):
        run_bench(args_for(tmp_path), engine_factory=lambda a: crashing)
    assert len(keys(path)) == 5  # every record produced before the crash is on disk
    kept = path.read_text()
    with open(path, "a") as f:  # the process died while writing the sixth record
        f.write('{"source": "specdec", "prompt_id": "p1", "config": "ngr')

    with pytest.raises(SpecdecError, match="--resume"):
        run_bench(args_for(tmp_path), engine_factory=lambda a: Recording())
    resumed = Recording()
    assert run_bench(args_for(tmp_path, "--resume"), engine_factory=lambda a: resumed) == 0
    assert len(resumed.generated) == 4 * 3 - 5  # exactly the missing ones
    final = keys(path)
    assert len(final) == len(set(final)) == 12
    assert path.read_text().startswith(kept)  # earlier records untouched
    assert (tmp_path / "out" / "report.md").exists()

    again = Recording()
    assert run_bench(args_for(tmp_path, "--resume"), engine_factory=lambda a: again) == 0
    assert again.generated == []  # nothing left: the report is rebuilt from the records


def test_resume_can_add_repeats_but_not_change_max_tokens(tmp_path):
    run_bench(args_for(tmp_path), engine_factory=lambda a: Recording())
    more = Recording()
    run_bench(args_for(tmp_path, "--resume", "--repeats", "2"), engine_factory=lambda a: more)
    assert len(more.generated) == 12
    with pytest.raises(SpecdecError, match="max_tokens"):
        run_bench(args_for(tmp_path, "--resume", "--max-tokens", "20"), engine_factory=lambda a: Recording())


def test_read_records_tolerates_only_a_torn_last_line(tmp_path):
    path = tmp_path / "records.jsonl"
    good = json.dumps({"prompt_id": "a", "config": "off", "repeat": 0})
    path.write_text(good + "\n" + '{"prompt_id": "b", "con')
    records, torn_at = read_records(path)
    assert len(records) == 1 and torn_at == len(good) + 1
    path.write_text(good + "\n" + good)  # whole JSON but no newline: the write did not finish
    assert read_records(path)[1] == len(good) + 1
    path.write_text("garbage\n" + good + "\n")
    with pytest.raises(SpecdecError, match="line 1"):
        read_records(path)


def test_record_file_truncates_the_torn_line_before_appending(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"prompt_id": "a", "config": "off", "repeat": 0}) + "\n{\"prompt_id\": \"b\"")
    with RecordFile(path, resume=True) as records:
        assert records.dropped_torn_line
        assert ("a", "off", 0) in records and ("b", "off", 0) not in records
        records.append({"prompt_id": "b", "config": "off", "repeat": 0})
    assert keys(path) == [("a", "off", 0), ("b", "off", 0)]


def test_an_interrupted_run_keeps_its_records_and_writes_a_partial_report(tmp_path):
    class Interrupting(Recording):
        def generate(self, request):
            if len(self.generated) >= 4:
                raise KeyboardInterrupt
            return super().generate(request)

    with pytest.raises(KeyboardInterrupt):
        run_bench(args_for(tmp_path), engine_factory=lambda a: Interrupting())
    assert len(keys(tmp_path / "out" / "records.jsonl")) == 4
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["summary"]["overall"]["off"]["succeeded"] == 2


def test_a_whole_last_line_that_is_not_a_record_is_cut_on_resume(tmp_path):
    path = tmp_path / "records.jsonl"
    good = json.dumps({"prompt_id": "a", "config": "off", "repeat": 0}) + "\n"
    path.write_text(good + "\x00\x00\x00\n")  # a crash can leave garbage that ends in a newline
    with RecordFile(path, resume=True) as records:
        assert records.dropped_torn_line and len(records.records) == 1
    assert path.read_text() == good


def test_two_runs_cannot_append_to_one_record_file(tmp_path):
    path = tmp_path / "records.jsonl"
    with RecordFile(path):
        with pytest.raises(SpecdecError, match="another benchmark is writing"):
            RecordFile(path, resume=True)
    with RecordFile(path, resume=True) as records:  # the lock went with the first
        assert records.records == []
