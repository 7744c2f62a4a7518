"""Why the server decoded at 0.6x `specdec generate`: OpenMP's threads per calling thread.

    python scripts/measure_decode_threads.py [--tokens 128] [--repeats 4]

Decodes the same greedy continuation (plain one-token steps, the target only):
  1. every call on the library thread (backends/library_thread.py), which also loaded the model:
     what specdec does, whoever calls;
  2. the same while a second thread that has called the library itself once is still alive (as
     the server's start-up calibration, before, left one in anyio's pool);
  3. from that second thread itself, the library called directly (the server's worker, before);
  4. on the library thread again once the second thread has ended;
and prints tokens/s of each repeat (docs/notebook.md, the Zen 5 entry, "The server's tax").
"""
from __future__ import annotations

import argparse
import queue
import threading
import time

from specdec.backends.registry import BackendConfig, ModelConfig, backend_entry
from specdec.models.registry import TARGET, default_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ik_llama.cpp:repacked")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    config = ModelConfig(BackendConfig.parse(args.backend))
    target = backend_entry(config.backend.backend).load(default_path(TARGET), config, 1, False)
    prompt = target.tokenize(target.apply_chat_template([{"role": "user", "content": "Explain how a hash map works."}]),
                             add_special=False)

    def decode(direct: bool) -> float:
        """tok/s of greedy one-token steps; `direct`: the library called from this thread itself."""
        evaluate = (lambda requests: target._eval_many(requests, False)) if direct else target.eval_many
        target.truncate(0, 0)
        target.eval(0, 0, prompt[:-1], prefill=True)
        token, position = prompt[-1], len(prompt) - 1
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            logits = evaluate([(0, position, [token])])[0]
            token, position = int(logits[-1].argmax()), position + 1
        return args.tokens / (time.perf_counter() - t0)

    def report(name: str, rates) -> None:
        print(f"{name}: " + ", ".join(f"{rate:.1f}" for rate in rates) + " tok/s", flush=True)

    jobs: "queue.Queue" = queue.Queue()
    results: "queue.Queue" = queue.Queue()

    def worker():
        while (job := jobs.get()) is not None:
            results.put(job())

    report("1. the library thread", [decode(direct=False) for _ in range(args.repeats)])
    helper = threading.Thread(target=worker)
    helper.start()
    jobs.put(lambda: decode(direct=True))
    results.get()  # the second thread has called the library once: an OpenMP pool of its own exists
    report("2. the library thread, a second calling thread alive", [decode(direct=False) for _ in range(args.repeats)])
    for _ in range(args.repeats):
        jobs.put(lambda: decode(direct=True))
    report("3. the second thread, directly", [results.get() for _ in range(args.repeats)])
    jobs.put(None)
    helper.join()  # its pool goes with it
    report("4. the library thread, the second thread ended", [decode(direct=False) for _ in range(args.repeats)])
    target.close()


if __name__ == "__main__":
    main()
