"""The real-pair tier: the default GGUF pair, loaded once for the whole tier."""
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


@pytest.fixture(scope="session")
def real_engine():
    from specdec.backends.llama_cpp import LlamaCppBackend
    from specdec.engine.engine import Engine
    from specdec.models.pull import verify_cached
    from specdec.models.registry import DRAFT, TARGET, default_path

    for spec in (TARGET, DRAFT):
        verify_cached(default_path(spec), spec)
    target = LlamaCppBackend(default_path(TARGET), n_ctx=4096)
    draft = LlamaCppBackend(default_path(DRAFT), n_ctx=4096)
    engine = Engine(target, draft)
    yield engine
    engine.close()


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.real_models)
