"""Spec-Bench prompts for the real-pair tier, read from ../shared/bench (never copied here)."""
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def spec_bench_path() -> Path:
    return Path(os.environ.get("SPECDEC_SPEC_BENCH") or REPO.parent / "shared" / "bench" / "spec_bench_questions.jsonl")


MT_BENCH_SUBCATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def spec_bench_prompts(per_category: dict) -> list[tuple[str, str]]:
    """(category, first turn) for the first N prompts of each Spec-Bench category, in file order."""
    path = spec_bench_path()
    if not path.exists():
        pytest.fail(f"Spec-Bench prompts not found at {path} (set SPECDEC_SPEC_BENCH)")
    taken: dict[str, int] = {}
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        category = "mt_bench" if record["category"] in MT_BENCH_SUBCATEGORIES else record["category"]
        if taken.get(category, 0) < per_category.get(category, 0):
            taken[category] = taken.get(category, 0) + 1
            out.append((category, record["turns"][0]))
    return out
