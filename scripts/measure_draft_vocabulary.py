"""The reduced-vocabulary draft beside the full one, in one process (docs/notebook.md, "A cheaper
draft step"): whether its logits equal the full draft's on every scored token, what one draft step
costs with each (interleaved, order alternating), and how much of a target's text the scored
tokens cover (from bench records: the `off` outputs).

    .venv/bin/python scripts/measure_draft_vocabulary.py [--sizes 8192,16384,32768] [--records R.jsonl ...]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from specdec.backends.bindings.ik_llama import binding
from specdec.backends.llama_family import LlamaFamilyBackend
from specdec.machine_profile import cpu_model_name
from specdec.models import reduced_vocabulary
from specdec.models.registry import DRAFT, default_path, models_dir

PROMPT = ("Summarize the article below in three sentences.\n\nThe city council met on Tuesday to discuss the "
          "new budget for public transport, parks and schools. ") * 12


def step_times(backends: dict, steps: int) -> dict:
    """Median and range of one-token steps per backend, after the same prompt, interleaved."""
    first = next(iter(backends.values()))
    prompt = first.tokenize(PROMPT)
    logits = {}
    for name, backend in backends.items():
        backend.truncate(0, 0)
        backend.eval(0, 0, prompt[:-1], prefill=True)
        logits[name] = backend.eval(0, len(prompt) - 1, prompt[-1:])[0]
    times = {name: [] for name in backends}
    token, position, mismatches = int(np.argmax(logits["full"])), len(prompt), 0
    names = list(backends)
    for step in range(steps):
        for name in (names if step % 2 else names[::-1]):
            start = time.perf_counter()
            logits[name] = backends[name].eval(0, position, [token])[0]
            times[name].append(time.perf_counter() - start)
        for name, backend in backends.items():
            if backend.vocabulary is not None:
                ids = backend.vocabulary.token_ids
                mismatches += int(not np.array_equal(logits[name][ids], logits["full"][ids]))
        token, position = int(np.argmax(logits["full"])), position + 1
    return {name: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t)}
            for name, t in times.items()} | {"steps_with_other_logits": mismatches}


def coverage(records: list[Path], vocabularies: dict) -> dict:
    tokens = [t for path in records for line in path.read_text().splitlines()
              for record in [json.loads(line)] if record.get("method") == "off" for t in record["output_token_ids"]]
    if not tokens:
        return {}
    counted = np.array(tokens)
    return {"tokens": len(tokens)} | {name: float(np.isin(counted, v.token_ids).mean()) for name, v in vocabularies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32768")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--records", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    source = default_path(DRAFT)
    vocabularies = {}
    for size in (int(s) for s in args.sizes.split(",")):
        start = time.perf_counter()
        vocabularies[f"vocab{size}"] = reduced_vocabulary.prepare(source, models_dir() / "derived", size)
        print(f"vocab{size}: ready in {time.perf_counter() - start:.1f} s")
    ik = binding()
    backends = {"full": LlamaFamilyBackend(ik, source, n_ctx=1024, proposals_only=True)}
    backends |= {name: LlamaFamilyBackend(ik, source, n_ctx=1024, proposals_only=True, vocabulary=v)
                 for name, v in vocabularies.items()}
    result = {"cpu": cpu_model_name(), "machine": platform.machine(), "threads": backends["full"].n_threads,
              "steps": step_times(backends, args.steps), "coverage": coverage(args.records, vocabularies)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
