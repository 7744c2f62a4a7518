"""Does the torch backend's batched evaluation give the logits of one-row steps, on a real model?

Evaluates k tokens after a 64-token prompt in one forward, then the same k tokens one per forward,
and prints per k the largest logit difference and whether the greedy tokens agree. Batched
(inexact) evaluation is what cheap verification would use; exact mode evaluates one row per forward.
Usage: python scripts/check_torch_exactness.py MODEL.gguf [bfloat16|float32]
"""
import json
import sys

import numpy as np

from specdec.backends.torch_backend import TorchBackend

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"


def main() -> None:
    model, dtype = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
    backend = TorchBackend(model, dtype=dtype, max_sequences=1, exact=False)
    tokens = (backend.tokenize(CODE * 8, add_special=False))[:64 + 16]
    backend.eval(0, 0, tokens[:64], prefill=True)
    for k in (2, 4, 8, 16):
        batched = backend.eval(0, 64, tokens[64:64 + k])
        backend.truncate(0, 64)
        rows = np.concatenate([backend.eval(0, 64 + i, tokens[64 + i:65 + i]) for i in range(k)])
        backend.truncate(0, 64)
        print(json.dumps({"dtype": dtype, "k": k, "bit_exact": bool(np.array_equal(batched, rows)),
                          "max_abs_logit_difference": float(np.max(np.abs(batched - rows))),
                          "greedy_tokens_agree": bool(np.array_equal(batched.argmax(1), rows.argmax(1)))}),
              flush=True)
    backend.close()


if __name__ == "__main__":
    main()
