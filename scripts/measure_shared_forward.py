"""Streams sharing a forward, measured: do N sequences evaluated together in one llama_decode of
one shared cache get, bit for bit, the logits each gets in a context of its own?

    python scripts/measure_shared_forward.py [--backend ik_llama.cpp:repacked] [--slots 4]

For each mix of prompts (short and past 600 tokens) and each slot arrangement, the target
processes every prompt in its slot of a shared-cache backend (the other slots holding other
prompts), then verifies each sequence's 1 + k rows in ONE eval_many call; the same prompt and
rows on a backend of one slot are the reference. Prints the largest logit difference per case
(0 everywhere is what docs/exactness.md claims) and the cost of a forward for 1..N streams.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from specdec.backends.registry import BackendConfig, ModelConfig, backend_entry
from specdec.models.registry import TARGET, default_path

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain, step by step, how a hash map resolves collisions, with an example in Python. " * 12,
    "List five prime numbers and say why each is prime.",
    "Summarize the plot of a story where a lighthouse keeper finds a message in a bottle. " * 20,
]
DRAFT = " The quick brown fox jumps over the lazy dog again and again until the end"


def load(label: str, slots: int, threads=None):
    config = ModelConfig(BackendConfig.parse(label), ctx_size=4096, threads=threads)
    return backend_entry(config.backend.backend).load(default_path(TARGET), config, slots, False)


def chat(backend, text: str) -> list[int]:
    return backend.tokenize(backend.apply_chat_template([{"role": "user", "content": text}]), add_special=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ik_llama.cpp:repacked")
    parser.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()
    alone, shared = load(args.backend, 1), load(args.backend, args.slots)
    print("shared backend:", shared.describe())
    prompts = [chat(alone, text) for text in PROMPTS]
    draft = alone.tokenize(DRAFT, add_special=False)
    worst = 0.0
    for k in (0, 1, 3, 7, 15):
        for arrangement in ([0, 1, 2, 3], [3, 1, 0, 2], [1, 3]):
            slots = [s for s in arrangement if s < args.slots]
            chosen = [prompts[i % len(prompts)] for i in range(len(slots))]
            reference = []
            for prompt in chosen:
                alone.truncate(0, 0)
                alone.eval(0, 0, prompt, prefill=True)
                reference.append(alone.eval(0, len(prompt), draft[:k + 1]))
            for slot in range(args.slots):  # foreign cells everywhere: the other slots hold other prompts
                shared.truncate(slot, 0)
                filler = prompts[(slot + 1) % len(prompts)]
                shared.eval(slot, 0, filler, prefill=True)
            for slot, prompt in zip(slots, chosen):
                shared.truncate(slot, 0)
                shared.eval(slot, 0, prompt, prefill=True)
            together = shared.eval_many([(slot, len(prompt), draft[:k + 1]) for slot, prompt in zip(slots, chosen)])
            diffs = [float(np.abs(mine - theirs).max()) for mine, theirs in zip(reference, together)]
            worst = max(worst, *diffs)
            print(f"k={k:2d} slots {slots}: prompt lengths {[len(p) for p in chosen]}, max |diff| per stream {diffs}")
    print(f"largest difference over every case: {worst}")
    # The price of sharing: one forward of 1 + k rows for 1..N streams, against N forwards.
    for k in (0, 3):
        for n in range(1, args.slots + 1):
            for slot in range(n):
                shared.truncate(slot, 0)
                shared.eval(slot, 0, prompts[slot % len(prompts)][:300], prefill=True)
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                shared.eval_many([(slot, min(300, len(prompts[slot % len(prompts)])), draft[:k + 1]) for slot in range(n)])
                times.append(time.perf_counter() - t0)
                for slot in range(n):
                    shared.truncate(slot, min(300, len(prompts[slot % len(prompts)])))
            print(f"k={k}: {n} stream(s) in one forward: median {np.median(times) * 1e3:.1f} ms")
    # One stream in the last slot while every other slot holds an idle prompt below it.
    for slot in range(args.slots):
        shared.truncate(slot, 0)
        shared.eval(slot, 0, prompts[3], prefill=True)
    last = args.slots - 1
    shared.truncate(last, 0)
    shared.eval(last, 0, prompts[0], prefill=True)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        shared.eval_many([(last, len(prompts[0]), draft[:1])])
        times.append(time.perf_counter() - t0)
        shared.truncate(last, len(prompts[0]))
    alone.truncate(0, 0)
    alone.eval(0, 0, prompts[0], prefill=True)
    solo = []
    for _ in range(7):
        t0 = time.perf_counter()
        alone.eval(0, len(prompts[0]), draft[:1])
        solo.append(time.perf_counter() - t0)
        alone.truncate(0, len(prompts[0]))
    print(f"one stream in slot {last}, the others idle below it: {np.median(times) * 1e3:.1f} ms a step "
          f"(a context of its own: {np.median(solo) * 1e3:.1f} ms)")
    alone.close()
    shared.close()


if __name__ == "__main__":
    main()
