"""Choose the grammar library by measurement: xgrammar against llguidance on the target's vocabulary.

For each JSON Schema of a small suite (tests/data/grammar_schemas.json): does the library
accept it, how long it takes to compile, and the median/p95 time to fill one token mask
(151,936 tokens for the default target) along a valid document's tokens. Prints one JSON line
per library and schema, then a summary. Run it alone on the machine:

    .venv/bin/python scripts/measure_grammar_libraries.py [--gguf PATH] [--repeats 3]

Needs both libraries installed (pip install xgrammar llguidance); reads the vocabulary from the
GGUF file's tokenizer (the model is never loaded).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (the GGUF stores BPE tokens in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def read_vocab(path: Path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = reader.fields

    def values(name):
        field = fields[name]
        return [field.parts[i] for i in field.data]

    tokens = [bytes(part).decode("utf-8") for part in values("tokenizer.ggml.tokens")]
    types = [int(part[0]) for part in values("tokenizer.ggml.token_type")]
    eos = int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    return tokens, types, eos


def load_suite() -> list[dict]:
    return json.loads((ROOT / "tests" / "data" / "grammar_schemas.json").read_text())["schemas"]


def measure_llguidance(tokens, types, eos, suite, tokenize, repeats):
    import llguidance
    import llguidance.numpy as lnp

    decoder = byte_decoder()
    raw = []
    for text, kind in zip(tokens, types):
        if kind in (3, 4) and text.startswith("<") and text.endswith(">"):  # control / user-defined
            raw.append(b"\xff" + text.encode())
        else:
            raw.append(bytes(decoder.get(ch, 0) for ch in text))

    class Tok:
        eos_token_id = eos
        bos_token_id = None
        special_token_ids = [i for i, kind in enumerate(types) if kind == 3]

        def __init__(self):
            self.tokens = raw

        def __call__(self, data: bytes):
            return tokenize(data)

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))
    setup = time.perf_counter() - t0
    results = []
    bitmask = lnp.allocate_token_bitmask(1, len(tokens))
    for case in suite:
        schema = json.dumps(case["schema"])
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        message = llguidance.LLMatcher.validate_grammar(grammar, lltok)  # "" when valid
        compile_s = time.perf_counter() - t0
        if message and not message.startswith("WARNING"):
            results.append({"library": "llguidance", "schema": case["name"], "supported": False, "error": message[:200]})
            continue
        doc_tokens = tokenize(json.dumps(case["instance"]).encode())
        fills = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            first = time.perf_counter() - t0
            for token in doc_tokens:
                t1 = time.perf_counter()
                lnp.fill_next_token_bitmask(matcher, bitmask, 0)
                fills.append(time.perf_counter() - t1)
                if not matcher.consume_token(token):
                    break
            valid = not matcher.is_error()
        results.append(summary("llguidance", case, compile_s + first, fills, valid, len(doc_tokens)))
    return setup, results


def measure_xgrammar(tokens, types, eos, suite, tokenize, repeats):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=len(tokens), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, len(tokens))
    results = []
    for case in suite:
        schema = json.dumps(case["schema"])
        t0 = time.perf_counter()
        try:
            compiled = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        except Exception as exc:  # the library's own refusal
            results.append({"library": "xgrammar", "schema": case["name"], "supported": False, "error": str(exc)[:200]})
            continue
        compile_s = time.perf_counter() - t0
        doc_tokens = tokenize(json.dumps(case["instance"]).encode())
        fills = []
        valid = True
        for _ in range(repeats):
            matcher = xgr.GrammarMatcher(compiled)
            for token in doc_tokens:
                t1 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, 0)
                fills.append(time.perf_counter() - t1)
                if not matcher.accept_token(token):
                    valid = False
                    break
        results.append(summary("xgrammar", case, compile_s, fills, valid, len(doc_tokens)))
    del torch
    return setup, results


def summary(library, case, compile_s, fills, valid, n_tokens) -> dict:
    fills_ms = sorted(1000 * f for f in fills)
    return {"library": library, "schema": case["name"], "supported": True, "document_accepted": valid,
            "compile_ms": round(1000 * compile_s, 2), "tokens": n_tokens,
            "mask_ms_median": round(statistics.median(fills_ms), 4),
            "mask_ms_p95": round(fills_ms[int(0.95 * (len(fills_ms) - 1))], 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=Path.home() / ".cache/specdec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokens, types, eos = read_vocab(args.gguf)
    suite = load_suite()
    # A byte-level greedy longest-match tokenizer is enough to walk a document (any valid split works).
    decoder = byte_decoder()
    by_bytes = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == 1:
            by_bytes.setdefault(bytes(decoder.get(ch, 0) for ch in text), i)
    longest = max(map(len, by_bytes))

    def tokenize(data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(longest, len(data) - i), 0, -1):
                token = by_bytes.get(data[i:i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                raise ValueError(f"no token for byte {data[i]}")
        return out

    totals = {}
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            setup, results = measure(tokens, types, eos, suite, tokenize, args.repeats)
        except ImportError as exc:
            print(json.dumps({"library": name, "missing": str(exc)}))
            continue
        for row in results:
            print(json.dumps(row))
        ok = [r for r in results if r["supported"] and r.get("document_accepted")]
        totals[name] = {
            "tokenizer_setup_s": round(setup, 2),
            "schemas_supported": f"{len(ok)}/{len(results)}",
            "compile_ms_median": round(statistics.median(r["compile_ms"] for r in ok), 2) if ok else None,
            "compile_ms_max": max((r["compile_ms"] for r in ok), default=None),
            "mask_ms_median_of_medians": round(statistics.median(r["mask_ms_median"] for r in ok), 4) if ok else None,
            "mask_ms_p95_max": max((r["mask_ms_p95"] for r in ok), default=None),
        }
    print(json.dumps({"summary": totals, "vocab": len(tokens)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
