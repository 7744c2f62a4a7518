"""Spec-Bench prompts for the real-pair tier, read where the benchmark reads them (never copied here)."""
from specdec.bench.datasets import load_prompts


def spec_bench_prompts(per_category: dict) -> list[tuple[str, str]]:
    """(category, first turn) for the first N prompts of each named Spec-Bench category, in file order."""
    chosen = load_prompts("spec-bench", categories=list(per_category), per_category=max(per_category.values()))
    counts: dict[str, int] = {}
    out = []
    for prompt in chosen:
        counts[prompt.category] = counts.get(prompt.category, 0) + 1
        if counts[prompt.category] <= per_category[prompt.category]:
            out.append((prompt.category, prompt.text))
    return out
