"""Measure, side by side in one process, what exact verification costs and whether it is exact.

Loads the target on every llama.cpp-family backend named, exact (the default) and --inexact (the
library's stock fast paths), and, after a short and a long Spec-Bench prompt, evaluates
n = 1..16 tokens in one call and as n one-token steps; reports t(1), v(n) = t(n)/t(1) (medians
over interleaved repeats, the order of the configurations reversed on odd repeats) and the
largest logit difference between the batched and the one-step logits. Not run in CI.

    .venv/bin/python scripts/measure_exactness.py [--backends ik_llama.cpp,llama.cpp] [--repeats 5] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specdec.backends.registry import REGISTRY, BackendConfig, ModelConfig
from specdec.backends.sequence import CachedSequence
from specdec.engine.engine import Engine
from specdec.models.registry import TARGET, default_path
from specdec.runtime import load_backend

SIZES = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16]  # n evaluated at once
CONTINUATION = " The quick brown fox jumps over the lazy dog again and again until the very end of the day"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spec-bench", default=os.environ.get("SPECDEC_SPEC_BENCH", "../shared/bench/spec_bench_questions.jsonl"))
    parser.add_argument("--backends", default=",".join(name for name in ("ik_llama.cpp", "llama.cpp")
                                                       if REGISTRY[name].installed()))
    parser.add_argument("--out", help="also write the markdown tables here")
    args = parser.parse_args()

    records = [json.loads(line) for line in Path(args.spec_bench).read_text().splitlines()]
    backends = {}
    for name in args.backends.split(","):
        for exact in (True, False):
            config = BackendConfig(name, None, exact)
            backends[config.label] = load_backend(ModelConfig(config), default_path(TARGET))
    engine = Engine(next(iter(backends.values())))
    prompts = {
        "short": engine.encode_prompt(records[0]["turns"][0], chat=True),
        "long": engine.encode_prompt(next(r for r in records if r["category"] == "summarization")["turns"][0], chat=True),
    }
    continuation = engine.target.tokenize(CONTINUATION, add_special=False)[:16]
    lines = []
    for context, prefix in prompts.items():
        times = {(mode, n): [] for mode in backends for n in SIZES}
        max_diff = {}
        sequences = {mode: CachedSequence(b, 0) for mode, b in backends.items()}
        steps = {}
        for mode, seq in sequences.items():
            seq.prefill(prefix)
            steps[mode] = np.concatenate([seq.extend([t]) for t in continuation])
        for repeat in range(args.repeats):
            order = list(sequences.items()) if repeat % 2 == 0 else list(sequences.items())[::-1]
            for n in SIZES:
                for mode, seq in order:  # interleaved: noise hits all alike
                    seq.truncate(len(prefix))
                    t0 = time.perf_counter()
                    batched = seq.extend(continuation[:n])
                    times[(mode, n)].append(time.perf_counter() - t0)
                    max_diff[(mode, n)] = float(np.abs(batched - steps[mode][:n]).max())
        for seq in sequences.values():
            seq.clear()
        lines.append(f"\n### {context} context ({len(prefix)} prompt tokens), {args.repeats} repeats\n")
        lines.append("| configuration | t(1) ms | " + " | ".join(f"v({n})" for n in SIZES) + " | max logit diff, batched vs steps |")
        lines.append("|---|---|" + "---|" * len(SIZES) + "---|")
        for mode in backends:
            t1 = statistics.median(times[(mode, 1)])
            vs = " | ".join(f"{statistics.median(times[(mode, n)]) / t1:.2f}" for n in SIZES)
            diffs = ", ".join(f"{n}:{max_diff[(mode, n)]:.2g}" for n in SIZES)
            lines.append(f"| {mode} | {t1 * 1000:.1f} | {vs} | {diffs} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
