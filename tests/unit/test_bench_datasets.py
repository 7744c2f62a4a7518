"""Prompt loaders: Spec-Bench from the shared folder (never copied into the repository) and user
JSONL with `prompt`, `messages` or `turns`; category filters and deterministic selection."""
import json
from collections import Counter
from pathlib import Path

import pytest

from specdec.bench.datasets import SPEC_BENCH_ENV, load_prompts, spec_bench_path
from specdec.types import SpecdecError

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "bench"
SPEC_BENCH_FILE = SHARED / "spec_bench_questions.jsonl"
needs_shared = pytest.mark.skipif(
    not SPEC_BENCH_FILE.exists(),
    reason=f"Spec-Bench is not at {SPEC_BENCH_FILE} (the shared data folder beside the repository)",
)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(SPEC_BENCH_ENV, raising=False)


@needs_shared
def test_spec_bench_has_six_tasks_of_80_with_mt_bench_grouped():
    prompts = load_prompts("spec-bench")
    assert len(prompts) == 480
    counts = Counter(p.category for p in prompts)
    assert list(counts) == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert set(counts.values()) == {80}
    assert sorted(int(p.id) for p in prompts if p.category == "mt_bench") == list(range(81, 161))


@needs_shared
def test_spec_bench_uses_the_first_turn_only():
    rows = [json.loads(line) for line in SPEC_BENCH_FILE.read_text().splitlines()]
    first = load_prompts("spec-bench")[0]
    assert first.id == "81"
    assert first.messages == ({"role": "user", "content": rows[0]["turns"][0]},)


@needs_shared
def test_per_category_takes_the_first_n_in_file_order():
    prompts = load_prompts("spec-bench", per_category=5)
    assert len(prompts) == 30
    by_category = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(int(p.id))
    assert by_category["mt_bench"] == [81, 82, 83, 84, 85]
    assert by_category["translation"] == [161, 162, 163, 164, 165]
    assert by_category["rag"] == [481, 482, 483, 484, 485]
    assert load_prompts("spec-bench", per_category=5) == prompts  # deterministic


@needs_shared
def test_category_filter_keeps_file_order_and_rejects_unknown_names():
    prompts = load_prompts("spec-bench", categories=["qa", "mt_bench"], per_category=2)
    assert [(p.category, p.id) for p in prompts] == [("mt_bench", "81"), ("mt_bench", "82"), ("qa", "321"), ("qa", "322")]
    with pytest.raises(SpecdecError, match="unknown categories writing"):
        load_prompts("spec-bench", categories=["writing"])


@needs_shared
def test_mt_bench_file_loads_as_a_user_file_with_its_own_categories():
    prompts = load_prompts(str(SHARED / "mt_bench_questions.jsonl"))
    assert len(prompts) == 80
    assert Counter(p.category for p in prompts)["writing"] == 10  # not regrouped outside spec-bench


def test_spec_bench_path_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 5, "category": "coding", "turns": ["a", "b"]}) + "\n")
    monkeypatch.setenv(SPEC_BENCH_ENV, str(path))
    assert spec_bench_path() == path
    (prompt,) = load_prompts("spec-bench")
    assert (prompt.id, prompt.category, prompt.text) == ("5", "mt_bench", "a")


def test_missing_spec_bench_says_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv(SPEC_BENCH_ENV, str(tmp_path / "absent.jsonl"))
    with pytest.raises(SpecdecError, match="hemingkx/Spec-Bench"):
        load_prompts("spec-bench")


def test_user_jsonl_with_prompt_messages_and_turns(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "plain text", "category": "x"},
        {"id": "m1", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                  {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]},
        {"turns": ["first", "second"], "category": "x"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    prompts = load_prompts(str(path))
    assert [p.id for p in prompts] == ["1", "m1", "3"]  # line numbers when no id is given
    assert [p.category for p in prompts] == ["x", "default", "x"]
    assert prompts[0].messages == ({"role": "user", "content": "plain text"},)
    assert prompts[1].messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"})
    assert prompts[2].text == "first"
    assert [p.id for p in load_prompts(str(path), per_category=1)] == ["1", "m1"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "x"}', "needs `prompt`, `messages` or `turns`"),
    ('{"prompt": ', "not valid JSON"),
    ('{"messages": [{"role": "system", "content": "s"}]}', "no user message"),
    ('{"turns": []}', "non-empty list"),
    ('{"prompt": "  "}', "empty"),
])
def test_bad_user_lines_are_reported_with_their_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(SpecdecError, match=message) as info:
        load_prompts(str(path))
    assert "bad.jsonl:2" in str(info.value)


def test_duplicate_ids_and_bad_selection_are_errors(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(SpecdecError, match="duplicate prompt id"):
        load_prompts(str(path))
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(SpecdecError, match="at least 1"):
        load_prompts(str(path), per_category=0)
    with pytest.raises(SpecdecError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
