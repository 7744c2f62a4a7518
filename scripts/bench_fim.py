"""Fill-in-the-middle speed: function bodies of the standard library cut out and asked back, `off` vs `auto`.

    python scripts/bench_fim.py [--files json/decoder.py,textwrap.py,shlex.py] [--per-file 4]
                                [--repeats 3] [--max-tokens 256] [--methods off,auto] [--out fim.jsonl]
                                [model options of `specdec generate`: --backend, --threads, ...]

Each prompt is a function of a file of this interpreter's standard library (the same files and
functions on every run of one Python version): its body after the docstring is the middle, the
file before it the prefix, the file after it the suffix, rendered as `/infill` renders them
(server/fim.py: llama-server's window, Qwen's FIM tokens). Greedy; the methods interleaved per
(prompt, repeat), their order alternating; every cache cleared before each generation. Prints
per method the median decode tok/s (IQR), the median per-prompt speedup over the first method
(IQR), and whether every method's tokens equal the first's (lossless decoding: they must).
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import sysconfig
from pathlib import Path

from specdec.bench.runner import reset_between_generations
from specdec.config_flags import add_model_arguments, config_from_args
from specdec.runtime import load_engine
from specdec.server.fim import InfillRequest, encode_infill, fim_stop_tokens
from specdec.types import GenerationRequest, SamplingParams, SpecConfig

DEFAULT_FILES = "json/decoder.py,textwrap.py,shlex.py"


def cut_functions(path: Path, per_file: int, min_lines: int = 3, max_lines: int = 40) -> list[dict]:
    """Up to `per_file` functions of `path`, evenly spaced in source order, each as (prefix,
    middle, suffix): the middle is the body after any docstring, whole lines."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring stays in the prefix: it says what to write
        if not body:
            continue
        first, last = body[0].lineno, node.end_lineno
        if not min_lines <= last - first + 1 <= max_lines:
            continue
        found.append({"name": f"{path.name}:{node.name}:{node.lineno}", "prefix": "".join(lines[:first - 1]),
                      "middle": "".join(lines[first - 1:last]), "suffix": "".join(lines[last:]), "line": first})
    found.sort(key=lambda f: f["line"])
    if len(found) <= per_file:
        return found
    step = len(found) / per_file
    return [found[int(i * step)] for i in range(per_file)]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default=DEFAULT_FILES, help=f"standard library files (default {DEFAULT_FILES})")
    parser.add_argument("--per-file", type=int, default=4, help="functions per file (default 4)")
    parser.add_argument("--max-prompts", type=int, default=None, help="at most this many prompts in all (smoke tests)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--methods", default="off,auto", help="comma-separated; the first is the baseline")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="default: the engine's")
    parser.add_argument("--out", help="write one JSON record per generation here")
    add_model_arguments(parser)
    args = parser.parse_args()
    methods = args.methods.split(",")

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = [f for name in args.files.split(",") for f in cut_functions(stdlib / name, args.per_file)]
    prompts = prompts[:args.max_prompts] if args.max_prompts else prompts
    print(f"bench_fim: {len(prompts)} functions from {stdlib} (Python {sys.version.split()[0]}), "
          f"methods {methods}, {args.repeats} repeats, {args.max_tokens} tokens", file=sys.stderr)

    config = config_from_args(args)
    models = config.models
    if not {"draft", "auto"} & set(methods):
        models = models.without_draft()
    engine = load_engine(models, engine=config.engine)
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    try:
        if "auto" in methods:
            from specdec.machine_profile import load_or_calibrate

            load_or_calibrate(engine)
        stops = fim_stop_tokens(engine.target)
        encoded = [encode_infill(engine.target, InfillRequest(input_prefix=p["prefix"], input_suffix=p["suffix"]),
                                 args.max_tokens) for p in prompts]
        rates: dict[str, list[float]] = {m: [] for m in methods}
        per_prompt: dict[str, list[list[float]]] = {m: [[] for _ in prompts] for m in methods}
        same = {m: 0 for m in methods[1:]}
        runs = 0
        for repeat in range(args.repeats):
            for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
                order = methods if (repeat + index) % 2 == 0 else methods[::-1]
                tokens = {}
                for method in order:
                    spec = SpecConfig(method) if args.num_draft_tokens is None else SpecConfig(method,
                                                                                              args.num_draft_tokens)
                    request = GenerationRequest(tuple(ids), args.max_tokens, SamplingParams(), spec,
                                                stop_token_ids=stops)
                    reset_between_generations(engine)
                    result = engine.generate(request)
                    rate = result.stats.get("tokens_per_second") or 0.0
                    rates[method].append(rate)
                    per_prompt[method][index].append(rate)
                    tokens[method] = list(result.token_ids)
                    if out:
                        out.write(json.dumps({"prompt": prompt["name"], "repeat": repeat, "method": method,
                                              "order": order.index(method), "prompt_tokens": len(ids),
                                              "tokens": len(result.token_ids), "tokens_per_second": rate,
                                              "finish_reason": result.finish_reason, "text": result.text,
                                              "expected": prompt["middle"], "stats": result.stats}) + "\n")
                runs += 1
                for method in methods[1:]:
                    same[method] += tokens[method] == tokens[methods[0]]
                print(f"  r{repeat} {prompt['name']}: " + ", ".join(
                    f"{m} {per_prompt[m][index][-1]:.1f} tok/s ({len(tokens[m])} tok)" for m in methods),
                      file=sys.stderr, flush=True)
    finally:
        if out:
            out.close()
        engine.close()

    print(f"\nFIM, {len(prompts)} functions x {args.repeats} repeats, greedy, decode tok/s (median, IQR):")
    for method in methods:
        q1, q2, q3 = quartiles(rates[method])
        print(f"  {method:8s} {q2:7.1f}  ({q1:.1f}-{q3:.1f})")
    base = methods[0]
    for method in methods[1:]:
        speedups = [statistics.median(r) / statistics.median(b) for r, b in zip(per_prompt[method], per_prompt[base])
                    if r and b and statistics.median(b) > 0]
        q1, q2, q3 = quartiles(speedups)
        print(f"  {method} / {base}, per prompt: median {q2:.2f}x (IQR {q1:.2f}-{q3:.2f}); "
              f"texts identical to {base}: {same[method]}/{runs}")
    return 0 if all(count == runs for count in same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
