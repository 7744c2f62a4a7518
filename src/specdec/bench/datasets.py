"""Benchmark prompts: Spec-Bench, or any JSONL with `prompt`, `messages` or `turns` per line.

Only the first user turn is used; the engine renders it with the model's chat template.
Third-party data is never copied into this repository: Spec-Bench is read from the path in
$SPECDEC_SPEC_BENCH or from ../shared/bench/ next to the repository.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from specdec.types import SpecdecError

SPEC_BENCH = "spec-bench"
SPEC_BENCH_ENV = "SPECDEC_SPEC_BENCH"
SPEC_BENCH_FILE = "spec_bench_questions.jsonl"
SPEC_BENCH_SOURCE = "https://github.com/hemingkx/Spec-Bench (data/spec_bench/question.jsonl)"
# Spec-Bench tags its 80 MT-Bench prompts (ids 81-160) by MT-Bench sub-category; the benchmark
# reports them as one task, as the Spec-Bench paper does.
MT_BENCH_SUBCATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
DEFAULT_CATEGORY = "default"


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: its id in the source file, its category, and the chat messages to send."""

    id: str
    category: str
    messages: tuple[dict, ...]  # the first user turn, after any system message
    response_format: Optional[dict] = None  # sent as is by `bench --server` (structured output)

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def spec_bench_path() -> Path:
    """$SPECDEC_SPEC_BENCH, else ../shared/bench/ beside the repository (or the working directory)."""
    env = os.environ.get(SPEC_BENCH_ENV)
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[3]
    candidates = [repo_root / ".." / "shared" / "bench" / SPEC_BENCH_FILE,
                  Path.cwd() / ".." / "shared" / "bench" / SPEC_BENCH_FILE]
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    return candidates[0]


def load_prompts(
    dataset: str,
    categories: Optional[Sequence[str]] = None,
    per_category: Optional[int] = None,
) -> list[BenchPrompt]:
    """Prompts of `dataset` ("spec-bench" or a JSONL path), filtered and selected deterministically.

    `categories` keeps only those categories (an unknown name is an error); `per_category` keeps
    the first N prompts of each category in file order. Categories keep their file order.
    """
    if dataset == SPEC_BENCH:
        path = spec_bench_path()
        if not path.exists():
            raise SpecdecError(
                f"Spec-Bench not found at {path}; download question.jsonl from {SPEC_BENCH_SOURCE} "
                f"and set {SPEC_BENCH_ENV} to its path."
            )
    else:
        path = Path(dataset)
        if not path.exists():
            raise SpecdecError(f"dataset file {path} does not exist (use 'spec-bench' or a JSONL path).")
    prompts = list(_parse_jsonl(path, spec_bench=dataset == SPEC_BENCH))
    if not prompts:
        raise SpecdecError(f"dataset {path} holds no prompts.")
    return select_prompts(prompts, categories, per_category)


def select_prompts(
    prompts: Sequence[BenchPrompt],
    categories: Optional[Sequence[str]] = None,
    per_category: Optional[int] = None,
) -> list[BenchPrompt]:
    if per_category is not None and per_category <= 0:
        raise SpecdecError("--per-category must be at least 1.")
    known = list(dict.fromkeys(p.category for p in prompts))
    wanted = list(known)
    if categories:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SpecdecError(f"unknown categories {', '.join(unknown)}; this dataset has {', '.join(known)}.")
        wanted = [c for c in known if c in set(categories)]
    taken: dict[str, int] = {c: 0 for c in wanted}
    selected = []
    for prompt in prompts:
        if prompt.category not in taken:
            continue
        if per_category is not None and taken[prompt.category] >= per_category:
            continue
        taken[prompt.category] += 1
        selected.append(prompt)
    return selected


def _parse_jsonl(path: Path, spec_bench: bool) -> Iterable[BenchPrompt]:
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecdecError(f"{path}:{line_no}: not valid JSON ({exc.msg}).") from None
            if not isinstance(row, dict):
                raise SpecdecError(f"{path}:{line_no}: each line must be a JSON object.")
            prompt = _prompt_from_row(row, line_no, path, spec_bench)
            if prompt.id in seen:
                raise SpecdecError(f"{path}:{line_no}: duplicate prompt id {prompt.id!r}.")
            seen.add(prompt.id)
            yield prompt


def _prompt_from_row(row: dict, line_no: int, path: Path, spec_bench: bool) -> BenchPrompt:
    where = f"{path}:{line_no}"
    raw_id = row.get("question_id", row.get("id", line_no))
    category = str(row.get("category") or DEFAULT_CATEGORY)
    if spec_bench and category in MT_BENCH_SUBCATEGORIES:
        category = "mt_bench"
    if "messages" in row:
        messages = _first_turn_messages(row["messages"], where)
    elif "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise SpecdecError(f"{where}: `turns` must be a non-empty list of strings.")
        messages = ({"role": "user", "content": turns[0]},)
    elif "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise SpecdecError(f"{where}: `prompt` must be a string.")
        messages = ({"role": "user", "content": row["prompt"]},)
    else:
        raise SpecdecError(f"{where}: each line needs `prompt`, `messages` or `turns`.")
    if not messages[-1]["content"].strip():
        raise SpecdecError(f"{where}: the prompt is empty.")
    response_format = row.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        raise SpecdecError(f"{where}: `response_format` must be an object.")
    return BenchPrompt(str(raw_id), category, messages, response_format)


def _first_turn_messages(messages, where: str) -> tuple[dict, ...]:
    """Messages up to and including the first user message (a leading system message is kept)."""
    if not isinstance(messages, list):
        raise SpecdecError(f"{where}: `messages` must be a list.")
    kept = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise SpecdecError(f"{where}: each message needs a string `content`.")
        role = message.get("role", "user")
        kept.append({"role": role, "content": message["content"]})
        if role == "user":
            return tuple(kept)
    raise SpecdecError(f"{where}: `messages` has no user message.")
