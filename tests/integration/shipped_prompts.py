"""The real-pair tier's prompts: written for specdec and shipped with it (tests/data/prompts.jsonl),
in Spec-Bench's six categories, so that the tests need nothing beside the repository."""
from pathlib import Path

from specdec.bench.datasets import load_prompts

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"


def shipped_prompts(per_category: dict) -> list[tuple[str, str]]:
    """(category, prompt) for the first N prompts of each named category, in file order."""
    chosen = load_prompts(str(PROMPTS_FILE), categories=list(per_category), per_category=max(per_category.values()))
    counts: dict[str, int] = {}
    out = []
    for prompt in chosen:
        counts[prompt.category] = counts.get(prompt.category, 0) + 1
        if counts[prompt.category] <= per_category[prompt.category]:
            out.append((prompt.category, prompt.text))
    return out
