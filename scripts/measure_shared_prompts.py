"""`n` choices sharing their prompt's processing, through HTTP: one request with `n` choices
against the same request whose choices each process the prompt (`cache_prompt: false`), and
`n: 1`, on the default pair. Each request's prompt starts with a line of its own, so no request
reuses another's. Not run in CI.

    .venv/bin/python scripts/measure_shared_prompts.py [--n 4] [--repeats 3] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx

from specdec.server.testing import free_port


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            sys.exit("the server exited while starting")
        time.sleep(2)
    server.kill()
    sys.exit("the server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--source", default="textwrap.py", help="a standard-library file whose start is the document")
    parser.add_argument("--chars", type=int, default=4000)
    args, extra = parser.parse_known_args()
    document = (Path(sysconfig.get_paths()["stdlib"]) / args.source).read_text()[:args.chars]
    port = free_port()
    server = start_server(port, extra)
    modes = {"shared": {"n": args.n}, "each its own": {"n": args.n, "cache_prompt": False}, "n=1": {"n": 1}}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=900) as client:
            model = client.get("/models").json()["data"][0]["id"]
            for repeat in range(args.repeats):
                order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
                for mode in order:
                    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.7, "seed": repeat,
                            "messages": [{"role": "user", "content": f"Request {repeat}-{mode}.\n{document}\n"
                                          "Summarise what this module does."}], **modes[mode]}
                    started = time.perf_counter()
                    response = client.post("/chat/completions", json=body)
                    elapsed = time.perf_counter() - started
                    response.raise_for_status()
                    usage = response.json()["usage"]
                    seconds[mode].append(elapsed)
                    print(f"r{repeat} {mode:>12}: {elapsed:6.2f} s, prompt {usage['prompt_tokens']} tokens, "
                          f"cached {usage.get('prompt_tokens_details', {}).get('cached_tokens')}, "
                          f"completion {usage['completion_tokens']}", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    for mode, values in seconds.items():
        print(f"{mode:>12}: median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
    ratios = [b / a for a, b in zip(seconds["shared"], seconds["each its own"])]
    print(f"each-its-own / shared: median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
