"""Write a `specdec batch` input (id + messages per line) from Spec-Bench prompts.

    python scripts/spec_bench_batch_input.py --per-category 8 --out batch-in.jsonl \
        --categories translation summarization qa math_reasoning rag
"""
from __future__ import annotations

import argparse
import json

from specdec.bench.datasets import SPEC_BENCH, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--categories", nargs="*", default=None)
    args = parser.parse_args()
    prompts = load_prompts(SPEC_BENCH, args.categories, args.per_category)
    with open(args.out, "w", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps({"id": f"{prompt.category}-{prompt.id}", "messages": list(prompt.messages)}) + "\n")
    print(f"wrote {len(prompts)} requests to {args.out}")


if __name__ == "__main__":
    main()
